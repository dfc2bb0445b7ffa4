"""RMS norms as transformers' families compute them, each in fp32 so half precision rounds the same way: the weight
after the cast back (Llama, Qwen, Mistral), before it (OLMo 2), or (1 + weight) before it with the weight starting at
0 (Gemma). A family picks its class; nothing here asks which family it is.

The weight is replicated across tp. Under sequence parallelism each rank normalises only its sequence shard, so its
weight gradient is a partial sum: routing the weight through f (identity forward, all-reduce backward) makes every
rank see the full-sequence gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from rayspeed.parallel.comm import copy_to_tp, sum_over_tp
from rayspeed.parallel.groups import TensorParallel
from rayspeed.parallel.layers import NO_TP


class RMSNorm(nn.Module):
    initial = 1.0

    def __init__(self, dim: int, eps: float = 1e-5, tp: Optional[TensorParallel] = None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.tp = tp or NO_TP
        self.eps = eps
        self.sequence_parallel = sequence_parallel and self.tp.enabled
        self.weight = nn.Parameter(torch.full((dim,), self.initial))
        if self.sequence_parallel:
            self.weight.sequence_parallel = True  # type: ignore[attr-defined]  # a tag torch's stubs do not declare

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tp(self.weight, self.tp) if self.sequence_parallel else self.weight
        x32 = x.float()
        return self.scaled(x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps), weight, x)

    def scaled(self, normed: torch.Tensor, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return normed.type_as(x) * weight


class Fp32WeightRMSNorm(RMSNorm):
    """The weight times the fp32 normalised tensor, then the cast (transformers' Olmo2RMSNorm)."""

    def scaled(self, normed: torch.Tensor, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (weight * normed).to(x.dtype)


class OffsetRMSNorm(RMSNorm):
    """Times (1 + weight) in fp32, then the cast; the weight starts at 0 (Gemma)."""
    initial = 0.0

    def scaled(self, normed: torch.Tensor, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (normed * (1.0 + weight.float())).type_as(x)


class ProjectionNorm(nn.Module):
    """RMS norm over a whole projection's `width` of which this rank holds width / tp (its heads), the weight
    applied in fp32 (OLMo 2's q/k norms).

    The mean of squares is summed over the tp group (a differentiable all-reduce, so the backward sums each rank's
    share of the normaliser's gradient), which makes every rank's slice exactly the slice of the whole normalised
    projection."""

    def __init__(self, width: int, eps: float, tp: TensorParallel):
        super().__init__()
        self.tp, self.eps, self.width = tp, eps, width
        self.weight = nn.Parameter(torch.ones(width // tp.world_size))
        # A tp shard like a column-parallel projection's rows: export gathers it, clipping and the gradient norm
        # count it once per shard (parallel/layers.py sharded_parameter marks its own the same way). The ignores: tags
        # set at run time, which torch's stubs do not declare.
        self.weight.tensor_model_parallel = True  # type: ignore[attr-defined]
        self.weight.partition_dim = 0  # type: ignore[attr-defined]
        self.weight.partition_stride = 1  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = sum_over_tp(x32.pow(2).sum(dim=-1, keepdim=True), self.tp)
        normed = x32 * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight * normed).to(x.dtype)
