"""Gemma 2's block, as transformers' Gemma2DecoderLayer computes it: four norms (before and after attention, before
and after the MLP: x + post(attn(pre(x))), then h + post(mlp(pre(h)))), all in Gemma's (1 + w) style. Its GeGLU,
sliding windows, attention scale and soft-capping and the scaled embedding are the decoder's, read from the shape.
Gemma 3's block is this one with per-head q/k norms (model/gemma3_block.py)."""

from __future__ import annotations

from rayspeed.config.shape import ModelShape
from rayspeed.model import transformer


class Block(transformer.Block):
    def __init__(self, cfg, layer_idx: int, tp=None, sequence_parallel: bool = False,
                 activation_checkpointing: str = "none", preserve_rng_state: bool = False, seed: int = 0):
        super().__init__(cfg, layer_idx, tp, sequence_parallel, activation_checkpointing, preserve_rng_state, seed)
        dims = ModelShape.from_config(cfg)
        tp, sp = self.attn.tp, self.attn.sequence_parallel
        self.attn_post_norm = self.norm_class(dims.hidden_size, dims.norm_eps, tp, sp, dims.family.norm)
        self.mlp_post_norm = self.norm_class(dims.hidden_size, dims.norm_eps, tp, sp, dims.family.norm)

    def attn_branch(self, x, segment_ids=None):
        return self.attn_post_norm(self.attn(self.attn_norm(x), segment_ids))

    def mlp_branch(self, x):
        return self.mlp_post_norm(self.mlp(self.mlp_norm(x)))
