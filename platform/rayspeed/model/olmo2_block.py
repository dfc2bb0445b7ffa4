"""OLMo 2's block, as transformers' Olmo2DecoderLayer computes it: each branch's output is RMS-normalised before it
joins the residual stream (x + norm(attn(x)), then h + norm(mlp(h)); no norm before the branches), and q and k are
RMS-normalised over their whole projections (heads x head_dim wide) before RoPE.

Under tensor parallelism a rank holds only its heads' part of each projection, and of the norm's weight: the mean
of squares is summed over the tp group (a differentiable all-reduce, so the backward sums each rank's share of the
normaliser's gradient), which makes every rank's slice exactly the slice of the whole normalised projection."""

from __future__ import annotations

import torch
from torch import nn

from rayspeed.config.shape import ModelShape
from rayspeed.model import transformer
from rayspeed.parallel.comm import sum_over_tp
from rayspeed.parallel.groups import TensorParallel


class ProjectionNorm(nn.Module):
    """RMS norm over a whole projection's `width` of which this rank holds width / tp (its heads)."""

    def __init__(self, width: int, eps: float, tp: TensorParallel):
        super().__init__()
        self.tp, self.eps, self.width = tp, eps, width
        self.weight = nn.Parameter(torch.ones(width // tp.world_size))
        # A tp shard like a column-parallel projection's rows: export gathers it, clipping and the gradient norm
        # count it once per shard (parallel/layers.py sharded_parameter marks its own the same way).
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim = 0
        self.weight.partition_stride = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = sum_over_tp(x32.pow(2).sum(dim=-1, keepdim=True), self.tp)
        normed = x32 * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight * normed).to(x.dtype)


class ProjectionNormAttention(transformer.Attention):
    def __init__(self, dims: ModelShape, tp: TensorParallel, sequence_parallel: bool, seed: int, name: str,
                 layer_idx: int = 0):
        super().__init__(dims, tp, sequence_parallel, seed, name, layer_idx)
        self.q_norm = ProjectionNorm(dims.q_dim, dims.norm_eps, tp)
        self.k_norm = ProjectionNorm(dims.kv_dim, dims.norm_eps, tp)

    def normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [b, heads, s, head_dim]: normalised over the projection (all heads of a position together)."""
        def over_projection(t: torch.Tensor, norm: ProjectionNorm) -> torch.Tensor:
            b, heads, s, d = t.shape
            flat = norm(t.transpose(1, 2).reshape(b, s, heads * d))
            return flat.view(b, s, heads, d).transpose(1, 2)

        return over_projection(q, self.q_norm), over_projection(k, self.k_norm)


class Block(transformer.Block):
    # attn_norm / mlp_norm keep the decoder's names (the checkpoint map says which norm each is): here they
    # normalise the branches' outputs, in the family's norm style (the weight applied in fp32, Olmo2RMSNorm's order).
    attention_class = ProjectionNormAttention

    def attn_branch(self, x, segment_ids=None):
        return self.attn_norm(self.attn(x, segment_ids))

    def mlp_branch(self, x):
        return self.mlp_norm(self.mlp(x))
