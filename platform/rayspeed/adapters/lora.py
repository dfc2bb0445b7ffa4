"""A LoRA (and DoRA) adapter beside one tensor-parallel linear layer: the function of peft's lora.Linear around the
same whole weight, computed from this rank's shards, with no gather of a base weight.

    column-parallel base (q, k, v, gate, up):  A whole (rank x in), B split by output rows, like W
    row-parallel base (o, down):               A split by input columns, like W; B whole (out x rank)

Column: each rank computes A x whole, then its rows of B (A x); A's gradient is a partial sum over the output
shards, so A enters through f (identity forward, all-reduce backward). Row: each rank's A_r x_r is a partial sum
of A x (rank numbers per token), reduced like the base output (all-reduce, or the sequence reduce-scatter under
sequence parallelism), then B (A x) is added to the reduced output; under sequence parallelism each rank holds a
sequence shard, so B's (and DoRA's magnitude's) gradients are partial sums and enter through f as well.

DoRA (peft's): y = W x + (m / ||W + s B A||_rows - 1) W x + (m / ||.||) s B A x, the norm detached. A column
shard holds whole rows; a row shard's partial squares are summed over tp.

Dropout on the adapter input follows tp1's mask on every layout: the generator draws the mask of the whole input
(every tp rank draws the same, the seed being the same), and a row-parallel adapter keeps its columns of it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from rayspeed.parallel.comm import copy_to_tp, sum_over_tp
from rayspeed.parallel.groups import TensorParallel
from rayspeed.parallel.layers import leave_tp_region, stable_seed


def full_uniform(shape: tuple[int, ...], bound: float, seed: int, key: str) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(stable_seed(seed, key))
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen)


def _mark_split(p: nn.Parameter, dim: int) -> nn.Parameter:
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
    return p


class LoraAdapter(nn.Module):
    """Beside the base layer whose `adapter` it is: forward(x, y, weight) gets the input the weight saw and the
    base layer's output (a column layer's output shard; a row layer's reduced output) and returns y plus the
    adapter's share.

    A starts as peft's (Kaiming-uniform, bound 1 / sqrt(in)), drawn whole from (seed, name) and sliced, so every
    layout starts from the same adapter; B starts at zero (the adapted model equals the base at step 0)."""

    def __init__(self, in_features: int, out_features: int, row: bool, tp: TensorParallel, *, rank: int,
                 scale: float, dropout: float, dora: bool, sequence_parallel: bool, seed: int, name: str,
                 weight: Optional[torch.Tensor] = None):
        super().__init__()
        self.name, self.row, self.tp, self.scale, self.p = name, row, tp, float(scale), float(dropout)
        self.sequence_parallel = sequence_parallel and tp.enabled
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.enabled = True
        a = full_uniform((rank, in_features), in_features ** -0.5, seed, f"{name}.lora_A")
        b = torch.zeros(out_features, rank)
        if tp.enabled:
            if row:
                a = a.chunk(tp.world_size, dim=1)[tp.rank]
            else:
                b = b.chunk(tp.world_size, dim=0)[tp.rank]
        self.lora_A = nn.Parameter(a.contiguous())
        self.lora_B = nn.Parameter(b.contiguous())
        if tp.enabled:
            _mark_split(self.lora_A, 1) if row else _mark_split(self.lora_B, 0)
        self.magnitude: Optional[nn.Parameter] = None
        if dora:
            if weight is None:
                raise ValueError(f"{name}: DoRA needs the base weight to start its magnitude")
            m = self.weight_norm(weight.detach().float()).to(weight.dtype)
            self.magnitude = nn.Parameter(m)
            if tp.enabled and not row:
                _mark_split(self.magnitude, 0)

    def dropped(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.p > 0):
            return x
        if not (self.row and self.tp.enabled):
            return F.dropout(x, self.p, training=True)
        # The whole input's mask (the same draw as tp1's), this rank's columns of it.
        shape = (*x.shape[:-1], x.shape[-1] * self.tp.world_size)
        keep = torch.empty(shape, device=x.device, dtype=x.dtype).bernoulli_(1.0 - self.p)
        keep = keep.chunk(self.tp.world_size, dim=-1)[self.tp.rank]
        return x * keep / (1.0 - self.p)

    def replicated(self, p: torch.Tensor) -> torch.Tensor:
        """A whole parameter whose gradient here is a partial sum over the tp ranks: it enters through f."""
        return copy_to_tp(p, self.tp)

    def delta_weight(self) -> torch.Tensor:
        """This rank's part of B A (the rows, or the columns, that its base weight holds), computed as peft's DoRA
        does (through the layers, on an identity) so that the row norms round alike."""
        eye = torch.eye(self.lora_A.shape[1], device=self.lora_A.device, dtype=self.lora_A.dtype)
        return F.linear(F.linear(eye, self.lora_A), self.lora_B).T

    def weight_norm(self, weight: torch.Tensor) -> torch.Tensor:
        """||W + s B A|| over each output row of the whole matrix (no gradient: DoRA detaches it)."""
        with torch.no_grad():
            w = weight + self.scale * self.delta_weight().to(weight.dtype)
            if not (self.row and self.tp.enabled):
                return torch.linalg.norm(w, dim=1)
            return sum_over_tp(w.float().square().sum(dim=1), self.tp).sqrt().to(w.dtype)

    def forward(self, x: torch.Tensor, y: torch.Tensor, weight: Optional[torch.Tensor],
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.enabled:  # adapters_disabled: the base layer alone (a DPO reference without a copy)
            return y
        h = self.dropped(x)
        if self.row:
            z = leave_tp_region(F.linear(h, self.lora_A), self.tp, self.sequence_parallel)
            b = self.replicated(self.lora_B) if self.sequence_parallel else self.lora_B
            lora = F.linear(z, b)
        else:
            lora = F.linear(F.linear(h, self.replicated(self.lora_A)), self.lora_B)
        if self.magnitude is None:
            return y + lora * self.scale
        if weight is None:
            raise ValueError(f"{self.name}: DoRA needs its base weight every forward")
        m = self.replicated(self.magnitude) if (self.row and self.sequence_parallel) else self.magnitude
        mag = m / self.weight_norm(weight).to(m.dtype)
        if h is x:  # the base output without its bias (peft's base_result)
            base = y if bias is None else y - bias
        else:  # with dropout, peft's DoRA scales the base applied to the dropped input
            base = F.linear(h, weight)
            if self.row:
                base = leave_tp_region(base, self.tp, self.sequence_parallel)
        return y + ((mag - 1) * base + mag * lora * self.scale)  # peft's order of the same terms

    def extra_repr(self) -> str:
        kind = "row" if self.row else "column"
        return (f"{kind}, in={self.in_features}, out={self.out_features}, rank={self.rank}, scale={self.scale:g}, "
                f"dropout={self.p:g}, dora={self.magnitude is not None}, tp={self.tp.world_size}")


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The model's base alone while inside (peft's disable_adapter): every LoRA adapter adds nothing."""
    adapters = [m for m in model.modules() if isinstance(m, LoraAdapter)]
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a in adapters:
            a.enabled = True
