"""Qwen3's block: the decoder's block whose attention RMS-normalises each query and key head (a weight of
head_dim, shared by every head and so whole on every tensor-parallel rank) before RoPE, as transformers'
Qwen3Attention does."""

from __future__ import annotations

from typing import Optional

import torch

from rayspeed.config.shape import ModelShape
from rayspeed.model import transformer
from rayspeed.parallel.groups import TensorParallel
from rayspeed.parallel.layers import NO_TP


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
    def __init__(self, cfg, layer_idx: int, tp: Optional[TensorParallel] = None, sequence_parallel: bool = False,
                 activation_checkpointing: str = "none", preserve_rng_state: bool = False, seed: int = 0):
        super().__init__(cfg, layer_idx, tp, sequence_parallel, activation_checkpointing, preserve_rng_state, seed)
        dims = ModelShape.from_config(cfg)
        tp = tp or NO_TP
        self.attn = QKNormAttention(dims, tp, sequence_parallel and tp.enabled, seed, name=f"layers.{layer_idx}.attn")
