"""Context parallelism: each rank of a cp group holds a part of every sequence, and attention is the only place the
parts meet.

Which part: the sequence is cut into 2 x cp equal chunks and cp rank r holds chunks r and 2cp - 1 - r (the
"zigzag" split). Under a causal mask a query attends to the keys before it, so the last chunk costs about 2cp times
the first: pairing an early chunk with a late one gives every rank the same attention work, where contiguous
chunks would leave rank 0 idle while the last rank computes.

Two ways to attend across the parts (`scheme`; the attention itself is in model/attention.py):

- ulysses (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all turns [sequence part, all heads] into [whole
  sequence, heads / cp], each rank attends over the whole sequence for its heads, and a second all-to-all turns
  it back. Two all-to-alls of q, k, v and the output per layer; needs the (tp-local) heads and kv heads to
  divide by cp.
- ring (Liu et al. 2023): the queries stay; the keys and values travel around the cp group, cp - 1 sends per
  layer, and each block's output is merged with the others through its log-sum-exp (the online softmax of
  flash attention), so no rank ever holds the whole sequence's keys. Any head count.

Both mask with the global positions of the tokens (causal, documents, sliding windows), and RoPE rotates by the
global (document-relative) positions, so the function is that of the unsplit sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

SCHEMES = ("ulysses", "ring")


@dataclass(frozen=True)
class ContextParallel:
    """A cp group (ranks in cp-rank order), this rank's place in it and the attention scheme; world_size 1 (the
    default) is no context parallelism."""

    group: Optional[Any] = None
    rank: int = 0
    world_size: int = 1
    ranks: tuple = (0,)
    scheme: str = "ulysses"

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"cp scheme {self.scheme!r} is not one of {SCHEMES}")

    @classmethod
    def from_ranks(cls, group, ranks, scheme: str = "ulysses") -> "ContextParallel":
        return cls(group=group, rank=list(ranks).index(dist.get_rank()), world_size=len(ranks), ranks=tuple(ranks),
                   scheme=scheme)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


NO_CP = ContextParallel()


def chunk_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions cp rank `rank` holds of a seq_len-token sequence (zigzag: chunks rank and 2cp-1-rank)."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into 2 x cp = {2 * cp} equal chunks")
    c = seq_len // (2 * cp)
    late = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(late * c, (late + 1) * c)])


def shard(t: torch.Tensor, cp: ContextParallel, dim: int = 1) -> torch.Tensor:
    """This rank's part of a whole-sequence tensor (tokens, labels, document ids): what the loader hands it."""
    if not cp.enabled:
        return t
    return t.index_select(dim, chunk_index(t.shape[dim], cp.world_size, cp.rank).to(t.device))


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] positions that restart at 0 where each segment (document) starts: a packed document sees the
    positions it would see alone."""
    idx = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return idx - torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values


class SequenceLayout:
    """Where this rank's tokens sit in the whole sequence, built once per forward and shared by every layer: their
    global positions, the RoPE positions (from each document's start), and the document ids of every part."""

    def __init__(self, cp: ContextParallel, local_len: int, segment_ids: Optional[torch.Tensor], device):
        self.cp = cp
        total = local_len * cp.world_size
        self.index = [chunk_index(total, cp.world_size, r).to(device) for r in range(cp.world_size)]
        self.segments = None  # per cp rank: [b, local_len] document ids of its part
        self.whole_segments = None  # [b, seq_len]: the whole sequence's, in sequence order
        if segment_ids is None:
            self.rope_positions = self.index[cp.rank][None]
            return
        parts = [torch.empty_like(segment_ids) for _ in range(cp.world_size)]
        dist.all_gather(parts, segment_ids.contiguous(), group=cp.group)
        whole = segment_ids.new_empty((segment_ids.shape[0], total))
        for idx, part in zip(self.index, parts):
            whole[:, idx] = part
        self.segments, self.whole_segments = parts, whole
        self.rope_positions = segment_positions(whole)[:, self.index[cp.rank]]


# ---------------------------------------------------------------------------------------------- communication


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, cp: ContextParallel) -> torch.Tensor:
    n = cp.world_size
    parts = [p.contiguous() for p in x.chunk(n, dim=scatter_dim)]
    out = [torch.empty_like(parts[0]) for _ in range(n)]
    dist.all_to_all(out, parts, group=cp.group)
    return torch.cat(out, dim=gather_dim)


class AllToAll(torch.autograd.Function):
    """Scatter `scatter_dim` over the cp group and gather `gather_dim`; the backward is the opposite exchange."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, cp):
        ctx.dims, ctx.cp = (scatter_dim, gather_dim), cp
        return _all_to_all(x, scatter_dim, gather_dim, cp)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.cp), None, None, None


def _shift(x: torch.Tensor, cp: ContextParallel, step: int) -> torch.Tensor:
    """x sent `step` ranks up the ring; what comes back is the tensor of the rank `step` below."""
    dst = cp.ranks[(cp.rank + step) % cp.world_size]
    src = cp.ranks[(cp.rank - step) % cp.world_size]
    x = x.contiguous()
    out = torch.empty_like(x)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, dst, group=cp.group),
                                   dist.P2POp(dist.irecv, out, src, group=cp.group)])
    for r in reqs:
        r.wait()
    return out


class RingShift(torch.autograd.Function):
    """One hop around the ring; the gradient makes the hop back."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        return _shift(x, cp, 1)

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad, ctx.cp, -1), None


def sum_over_cp(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """A count summed over the cp group (no gradient: the loss divisor counts the whole sequence's labels)."""
    if not cp.enabled:
        return x
    x = x.detach().clone()
    dist.all_reduce(x, group=cp.group)
    return x
