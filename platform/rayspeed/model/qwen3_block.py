"""Qwen3's block: the decoder's block whose attention RMS-normalises each query and key head (a weight of
head_dim, shared by every head and so whole on every tensor-parallel rank) before RoPE, as transformers'
Qwen3Attention does."""

from __future__ import annotations

import torch

from rayspeed.config.shape import ModelShape
from rayspeed.model import transformer
from rayspeed.parallel.groups import TensorParallel


class QKNormAttention(transformer.Attention):
    """Per-head q/k norms in the family's norm style (Qwen3's, Gemma 3's (1 + w))."""

    def __init__(self, dims: ModelShape, tp: TensorParallel, sequence_parallel: bool, seed: int, name: str,
                 layer_idx: int = 0):
        super().__init__(dims, tp, sequence_parallel, seed, name, layer_idx)
        # Each tp rank normalises only its own heads, so its weight gradient is a partial sum: the weight goes
        # through the same identity-forward, all-reduce-backward path as a sequence-parallel norm's.
        style = dims.family.norm
        self.q_norm = transformer.RMSNorm(dims.head_dim, dims.norm_eps, tp, sequence_parallel=True, style=style)
        self.k_norm = transformer.RMSNorm(dims.head_dim, dims.norm_eps, tp, sequence_parallel=True, style=style)

    def normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Block(transformer.Block):
    attention_class = QKNormAttention
