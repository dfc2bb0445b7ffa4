"""Tensor- and sequence-parallel communication as autograd functions.

Megatron-LM (Shoeybi et al. 2019, section 3) builds tensor parallelism from two conjugate
operators placed around each column/row-parallel pair:

  f: identity in forward, all-reduce in backward   -> `copy_to_tp`
  g: all-reduce in forward, identity in backward   -> `reduce_from_tp`

Sequence parallelism (Korthikanti et al. 2022) replaces them so the regions between the
pairs (norms, residual adds) hold only 1/tp of the sequence:

  g-bar: all-gather along sequence in forward, reduce-scatter in backward  -> `gather_from_sequence`
  its conjugate: reduce-scatter in forward, all-gather in backward          -> `reduce_scatter_to_sequence`

Every wrapper is the identity when tp.world_size == 1, so unsharded runs never communicate.
Activations are batch-first [batch, seq, ...], so the sequence dimension is 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rayspeed.parallel.groups import TensorParallel

SEQ_DIM = 1


def _all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    # Reduce into a copy: autograd may hand the same gradient tensor to several branches.
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=tp.group)
    return x


def _all_gather(x: torch.Tensor, dim: int, tp: TensorParallel) -> torch.Tensor:
    # Collectives concatenate along dim 0; move the wanted dim there and back.
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] * tp.world_size, *x0.shape[1:]))
    dist.all_gather_single(out, x0, group=tp.group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, tp: TensorParallel) -> torch.Tensor:
    if x.shape[dim] % tp.world_size != 0:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not divide by tp={tp.world_size}")
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // tp.world_size, *x0.shape[1:]))
    dist.reduce_scatter_single(out, x0, group=tp.group)
    return out.movedim(0, dim).contiguous()


def _split(x: torch.Tensor, dim: int, tp: TensorParallel) -> torch.Tensor:
    if x.shape[dim] % tp.world_size != 0:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not divide by tp={tp.world_size}")
    return x.chunk(tp.world_size, dim=dim)[tp.rank].contiguous()


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward.

    Placed where a replicated activation enters column-parallel layers: each rank's
    gradient only covers its own output slice, and the sum over ranks is the full gradient.
    """

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.tp), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward.

    Placed after a row-parallel layer: each rank holds a partial sum of the output; the
    gradient of a sum is the same for every term, so backward passes it through.
    """

    @staticmethod
    def forward(ctx, x, tp):
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromTensorParallel(torch.autograd.Function):
    """All-gather along `dim` (default the last, hidden dim) forward, keep this rank's slice backward.

    Turns a column-parallel output into the full tensor (ColumnParallelLinear(gather_output=True)).
    Along the sequence dim it turns a sequence-parallel activation into a replicated one whose
    consumers are replicated too (every rank then holds the same, full gradient): see
    `gather_sequence_to_replicated`.
    """

    @staticmethod
    def forward(ctx, x, tp, dim=-1):
        ctx.tp, ctx.dim = tp, dim
        return _all_gather(x, dim, tp)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.tp), None, None


class ScatterToTensorParallel(torch.autograd.Function):
    """Keep this rank's slice of `dim` (default the last dim) forward, all-gather backward.

    Feeds a replicated input to RowParallelLinear(input_is_parallel=False), or (along the
    sequence dim) a replicated activation to a sequence-parallel region: see `split_to_sequence`.
    """

    @staticmethod
    def forward(ctx, x, tp, dim=-1):
        ctx.tp, ctx.dim = tp, dim
        return _split(x, dim, tp)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.tp), None, None


class GatherFromSequenceParallel(torch.autograd.Function):
    """Sequence-parallel g-bar: all-gather along the sequence forward, reduce-scatter backward.

    Replaces f before column-parallel layers when the input is sharded along the sequence:
    every rank needs the whole sequence, and each rank's gradient for it is a partial sum
    (over its output slice) of which it keeps only its own sequence shard.
    """

    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return _all_gather(x, dim, tp)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.tp), None, None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Sequence-parallel conjugate of g-bar: reduce-scatter along the sequence forward, all-gather backward.

    Replaces g after row-parallel layers: the partial sums are reduced and each rank keeps
    only its sequence shard for the norm / residual region that follows.
    """

    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return _reduce_scatter(x, dim, tp)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.tp), None, None


class SumOverTensorParallel(torch.autograd.Function):
    """All-reduce forward and backward: a statistic every rank uses whole (a norm's sum of squares over a width the
    ranks split), so each rank's share gets the sum of every rank's gradient of it."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.tp), None


def sum_over_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return SumOverTensorParallel.apply(x, tp) if tp.enabled else x


def copy_to_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return CopyToTensorParallel.apply(x, tp) if tp.enabled else x


def reduce_from_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return ReduceFromTensorParallel.apply(x, tp) if tp.enabled else x


def gather_from_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return GatherFromTensorParallel.apply(x, tp) if tp.enabled else x


def scatter_to_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return ScatterToTensorParallel.apply(x, tp) if tp.enabled else x


def gather_from_sequence(x: torch.Tensor, tp: TensorParallel, dim: int = SEQ_DIM) -> torch.Tensor:
    return GatherFromSequenceParallel.apply(x, tp, dim) if tp.enabled else x


def reduce_scatter_to_sequence(x: torch.Tensor, tp: TensorParallel, dim: int = SEQ_DIM) -> torch.Tensor:
    return ReduceScatterToSequenceParallel.apply(x, tp, dim) if tp.enabled else x


def gather_sequence_to_replicated(x: torch.Tensor, tp: TensorParallel, dim: int = SEQ_DIM) -> torch.Tensor:
    """Sequence shard -> the full sequence, replicated on every tp rank (all-gather; backward: keep own shard).

    Unlike `gather_from_sequence` (whose backward reduce-scatters the partial gradients of a
    tensor-parallel region), the gradient arriving here must already be the full, identical
    gradient on every rank: the output is consumed redundantly, not sliced. Used where an
    activation leaves sequence parallelism altogether, e.g. a pipeline stage boundary.
    """
    return GatherFromTensorParallel.apply(x, tp, dim) if tp.enabled else x


def split_to_sequence(x: torch.Tensor, tp: TensorParallel, dim: int = SEQ_DIM) -> torch.Tensor:
    """Replicated full sequence -> this rank's sequence shard (backward: all-gather the shard gradients).

    The inverse of `gather_sequence_to_replicated`: where a replicated activation enters a
    sequence-parallel region, e.g. the input of a pipeline stage.
    """
    return ScatterToTensorParallel.apply(x, tp, dim) if tp.enabled else x


def split_along(x: torch.Tensor, tp: TensorParallel, dim: int) -> torch.Tensor:
    """This rank's chunk of `x` along `dim` (no autograd communication; for inputs and tests)."""
    return _split(x, dim, tp) if tp.enabled else x


def all_gather_along(x: torch.Tensor, tp: TensorParallel, dim: int) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (no autograd; for checkpoints and tests)."""
    return _all_gather(x.detach(), dim, tp) if tp.enabled else x
