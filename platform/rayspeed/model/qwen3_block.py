"""Qwen3's block: the decoder's block whose attention RMS-normalises each query and key head (a weight of
head_dim, shared by every head and so whole on every tensor-parallel rank) before RoPE, as transformers'
Qwen3Attention does."""

from __future__ import annotations

import torch

from rayspeed.config.shape import ModelShape
from rayspeed.model import transformer
from rayspeed.parallel.groups import TensorParallel


class QKNormAttention(transformer.Attention):
    def __init__(self, dims: ModelShape, tp: TensorParallel, sequence_parallel: bool, seed: int, name: str):
        super().__init__(dims, tp, sequence_parallel, seed, name)
        # Each tp rank normalises only its own heads, so its weight gradient is a partial sum: the weight goes
        # through the same identity-forward, all-reduce-backward path as a sequence-parallel norm's.
        self.q_norm = transformer.RMSNorm(dims.head_dim, dims.norm_eps, tp, sequence_parallel=True)
        self.k_norm = transformer.RMSNorm(dims.head_dim, dims.norm_eps, tp, sequence_parallel=True)

    def normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Block(transformer.Block):
    attention_class = QKNormAttention
