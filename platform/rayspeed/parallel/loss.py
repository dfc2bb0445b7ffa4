"""Cross-entropy without full logits: chunked over tokens, and at tp>1 also split over the vocabulary.

Both return float32 and never call .item(): the mean divides by a device-side count of
non-ignored tokens, so the training step stays free of host syncs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rayspeed.parallel.groups import TensorParallel

IGNORE_INDEX = -100
# Largest logits block (tokens x vocab) materialised at once in fp32: 2**26 floats = 256 MiB.
LOSS_CHUNK_ELEMENTS = 1 << 26


def _reduce(losses: torch.Tensor, labels: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        count = (labels != ignore_index).sum().clamp(min=1)
        return losses.sum() / count
    raise ValueError(f"reduction must be mean, sum or none, got {reduction!r}")


def softcap(logits: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """cap * tanh(logits / cap) (Gemma 2's final-logit and attention soft-capping); the logits as they are without
    a cap."""
    return logits if not cap else cap * torch.tanh(logits / cap)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Per-token CE of softmax(h W^T), computing logits `chunk` tokens at a time.

    Forward keeps only the log-sum-exp per token; backward recomputes each chunk's logits
    to form (softmax - onehot). Peak memory is one chunk of fp32 logits instead of
    tokens x vocab, for the price of one extra h W^T matmul.

    With a tp group, `weight` is this rank's contiguous vocabulary slice: each chunk's log-sum-exp combines the
    slices by two all-reduces of per-token scalars (the max, then the target logit with the sum of exponentials),
    and the hidden states' gradient is this slice's part (the tp region's entry sums the parts in backward).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, ignore_index, cap=None, tp=None):
        n = hidden.shape[0]
        valid = labels != ignore_index
        if tp is not None:  # the labels this rank's slice holds, as indices into it
            start_id = tp.rank * weight.shape[0]
            local = labels - start_id
            owned = valid & (local >= 0) & (local < weight.shape[0])
            targets = local.masked_fill(~owned, 0)
        else:
            owned = valid
            targets = labels.masked_fill(~valid, 0)
        losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            logits = softcap(F.linear(hidden[start:end], weight).float(), cap)
            target_logit = logits.gather(1, targets[start:end, None]).squeeze(1)
            if tp is None:
                lse[start:end] = torch.logsumexp(logits, dim=-1)
            else:
                # No gradient flows through the max: it cancels out of log-sum-exp minus the target.
                top = logits.max(dim=-1).values
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp.group)
                sums = torch.stack([target_logit.masked_fill(~owned[start:end], 0.0),
                                    torch.exp(logits - top[:, None]).sum(dim=-1)])
                dist.all_reduce(sums, group=tp.group)  # one call for both: latency-bound per-token scalars
                target_logit = sums[0]
                lse[start:end] = top + torch.log(sums[1])
            losses[start:end] = lse[start:end] - target_logit
        losses = losses.masked_fill(~valid, 0.0)
        ctx.save_for_backward(hidden, weight, targets, valid, owned, lse)
        ctx.chunk, ctx.cap = chunk, cap
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, targets, valid, owned, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        scale = grad_losses.float() * valid
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Accumulate the weight gradient in fp32 across chunks, whatever the model dtype.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        n = hidden.shape[0]
        for start in range(0, n, ctx.chunk):
            end = min(start + ctx.chunk, n)
            h = hidden[start:end]
            capped = softcap(F.linear(h, weight).float(), ctx.cap)
            probs = torch.exp(capped - lse[start:end, None])
            rows = torch.arange(end - start, device=probs.device)
            probs[rows, targets[start:end]] -= owned[start:end].float()
            dlogits = probs * scale[start:end, None]
            if ctx.cap:  # through the cap: d(cap tanh(x / cap)) / dx = 1 - tanh^2
                dlogits = dlogits * (1.0 - (capped / ctx.cap) ** 2)
            dlogits = dlogits.to(hidden.dtype)
            if need_hidden:
                grad_hidden[start:end] = dlogits @ weight
            if need_weight:
                grad_weight += (dlogits.t() @ h).float()
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: Optional[int] = None,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    cap: Optional[float] = None,
    tp: Optional[TensorParallel] = None,
) -> torch.Tensor:
    """Cross-entropy of the logits hidden @ weight^T (soft-capped by `cap` when given) against labels, never
    holding all logits.

    hidden: [..., H]; weight: [V, H] (with an enabled tp: this rank's slice [V/tp, H]); labels: [...] global ids.
    chunk_tokens defaults to as many tokens as fit LOSS_CHUNK_ELEMENTS fp32 logits of the weight's rows.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    chunk = chunk_tokens or max(1, LOSS_CHUNK_ELEMENTS // weight.shape[0])
    group = tp if tp is not None and tp.enabled else None
    losses = _ChunkedLinearCrossEntropy.apply(h, weight, y, chunk, ignore_index, cap, group)
    return _reduce(losses, y, ignore_index, reduction)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Exact CE when each tp rank holds logits for a contiguous vocabulary slice.

    Two all-reduces of per-token scalars over the tp group: the max (for a stable
    log-sum-exp), then the target logit (owned by one rank, zero elsewhere) together with
    the sum of exponentials. Backward is local: softmax minus one-hot on this rank's slice.
    """

    @staticmethod
    def forward(ctx, logits, labels, tp, ignore_index):
        vocab_local = logits.shape[-1]
        start = tp.rank * vocab_local
        logits32 = logits.float()

        # No gradient flows through the max: it cancels out of log-sum-exp minus the target.
        max_logit = logits32.max(dim=-1).values
        dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = logits32 - max_logit[:, None]

        local_target = labels - start
        owned = (local_target >= 0) & (local_target < vocab_local)
        local_target = local_target.masked_fill(~owned, 0)
        target_logit = shifted.gather(1, local_target[:, None]).squeeze(1).masked_fill(~owned, 0.0)
        exp = shifted.exp_()
        # One all-reduce for both sums: these are latency-bound, per-token scalars.
        sums = torch.stack([target_logit, exp.sum(dim=-1)])
        dist.all_reduce(sums, group=tp.group)
        target_logit, sum_exp = sums[0], sums[1]

        valid = labels != ignore_index
        losses = (torch.log(sum_exp) - target_logit).masked_fill(~valid, 0.0)
        softmax = exp.div_(sum_exp[:, None])
        ctx.save_for_backward(softmax, local_target, owned, valid)
        ctx.logits_dtype = logits.dtype
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        softmax, local_target, owned, valid = ctx.saved_tensors
        # Reuse the saved softmax buffer: it is the size of this rank's logits.
        grad = softmax
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= owned.float()
        grad.mul_((grad_losses.float() * valid)[:, None])
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    tp: Optional[TensorParallel] = None,
    *,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy over logits split along the vocabulary across the tp group.

    logits_shard: [..., V/tp], this rank's contiguous vocab slice (rank r holds
    [r*V/tp, (r+1)*V/tp)); labels: [...] global token ids, identical on every tp rank.
    With no tp (or tp of size 1) this is plain F.cross_entropy in fp32.
    """
    x = logits_shard.reshape(-1, logits_shard.shape[-1])
    y = labels.reshape(-1)
    if tp is None or not tp.enabled:
        losses = F.cross_entropy(x.float(), y, ignore_index=ignore_index, reduction="none")
    else:
        losses = _VocabParallelCrossEntropy.apply(x, y, tp, ignore_index)
    return _reduce(losses, y, ignore_index, reduction)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    tp: Optional[TensorParallel] = None,
    *,
    chunk_tokens: Optional[int] = None,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    cap: Optional[float] = None,
) -> torch.Tensor:
    """The output head and its loss in one: CE(hidden @ weight^T, labels), the logits soft-capped by `cap` when
    given (Gemma 2).

    Chunked over tokens at every tp (a long sequence's logits are never whole: one chunk of this rank's vocabulary
    slice at a time). tp>1: `weight` is this rank's vocab slice and `hidden` must already be in the tp region
    (after f / the sequence all-gather); each chunk's slices combine by per-token all-reduces (the cap is
    element-wise: each rank caps its own slice).
    """
    return chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk_tokens, ignore_index=ignore_index,
                                        reduction=reduction, cap=cap, tp=tp)
