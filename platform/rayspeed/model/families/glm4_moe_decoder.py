"""GLM-4.5's decoder as transformers' Glm4MoeDecoderLayer computes it: the shared attention (q/k/v biases, partial
RoPE: the shape's), its per-head q/k norms only where config.json's use_qk_norm says so, and DeepSeek-V3's mixture
of experts (group-limited sigmoid routing with the score correction, shared experts beside)."""

from __future__ import annotations

import torch

from rayspeed.config.shape import ModelShape
from rayspeed.families import glm4_moe
from rayspeed.model.families import Composition
from rayspeed.model.families.deepseek_v3_decoder import DeepseekMoE
from rayspeed.model.parts.blocks import Block
from rayspeed.model.parts.norms import RMSNorm
from rayspeed.model.parts.self_attention import Attention
from rayspeed.parallel.groups import TensorParallel


class Glm4MoeAttention(Attention):
    def __init__(self, dims: ModelShape, tp: TensorParallel, sequence_parallel: bool, seed: int, name: str,
                 layer_idx: int = 0):
        super().__init__(dims, tp, sequence_parallel, seed, name, layer_idx)
        self.qk_norm = bool(dims.family_key("use_qk_norm"))
        if self.qk_norm:  # as QKNormAttention's: whole on every tp rank, its gradient summed over tp
            self.q_norm = RMSNorm(dims.head_dim, dims.norm_eps, tp, sequence_parallel=True)
            self.k_norm = RMSNorm(dims.head_dim, dims.norm_eps, tp, sequence_parallel=True)

    def normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.q_norm(q), self.k_norm(k)) if self.qk_norm else (q, k)


class Glm4MoeBlock(Block):
    attention_class = Glm4MoeAttention
    moe_class = DeepseekMoE


MODEL = Composition(families=(glm4_moe.FAMILY,), block=Glm4MoeBlock)
