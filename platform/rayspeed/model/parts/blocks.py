"""Transformer blocks: pre-norm (Llama), sandwich (Gemma's norms before and after each branch) and post-norm (OLMo 2's
branch outputs normalised), each with selective or full recomputation. A family's block is one of these with its
attention and norm classes named (rayspeed.model.families)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from rayspeed.config.shape import ModelShape
from rayspeed.model.moe import MoE
from rayspeed.model.parts.mlp import MLP, mlp_tile_rows
from rayspeed.model.parts.norms import RMSNorm
from rayspeed.model.parts.self_attention import Attention
from rayspeed.parallel.groups import TensorParallel
from rayspeed.parallel.layers import NO_TP

CHECKPOINTING_MODES = ("none", "selective", "full")


def check_mode(activation_checkpointing: str) -> str:
    if activation_checkpointing not in CHECKPOINTING_MODES:
        raise ValueError(f"activation_checkpointing must be one of {CHECKPOINTING_MODES}, "
                         f"got {activation_checkpointing!r}")
    return activation_checkpointing


class Block(nn.Module):
    """Pre-norm transformer block. Parameter names are `layers.{layer_idx}.*` wherever it lives.

    activation_checkpointing: "selective" recomputes the attention and MLP sub-blocks
    (norm included) in backward, "full" the whole block; both non-reentrant.
    A family's block (rayspeed.model.families.<name>) names its own attention or norm class here, or subclasses
    SandwichBlock or PostNormBlock.
    """

    attention_class: type = Attention
    norm_class: type = RMSNorm
    moe_class: type = MoE

    def __init__(
        self,
        cfg,
        layer_idx: int,
        tp: Optional[TensorParallel] = None,
        sequence_parallel: bool = False,
        activation_checkpointing: str = "none",
        preserve_rng_state: bool = False,
        seed: int = 0,
    ):
        super().__init__()
        dims = ModelShape.from_config(cfg)
        tp = tp or NO_TP
        sp = sequence_parallel and tp.enabled
        self.layer_idx = layer_idx
        self.activation_checkpointing = check_mode(activation_checkpointing)
        self.preserve_rng_state = preserve_rng_state
        prefix = f"layers.{layer_idx}"
        self.canonical_prefix = prefix  # where its parameters live in Transformer's state dict
        self.family = dims.family  # its checkpoint's names (the adapters of fused projections share one A)
        self.in_moe_model = dims.num_experts > 0  # adapters leave every MLP of a mixture of experts (config.adapter)
        self.attn_norm = self.norm_class(dims.hidden_size, dims.norm_eps, tp, sp)
        self.attn = self.attention_class(dims, tp, sp, seed, name=f"{prefix}.attn", layer_idx=layer_idx)
        self.mlp_norm = self.norm_class(dims.hidden_size, dims.norm_eps, tp, sp)
        self.mlp = (self.moe_class(dims, seed, f"{prefix}.mlp", tp=tp, sequence_parallel=sp) if dims.is_moe(layer_idx)
                    else MLP(dims, tp, sp, seed, name=f"{prefix}.mlp"))

    def _checkpointed(self, fn, *args):
        if not torch.is_grad_enabled():  # nothing to recompute without a backward
            return fn(*args)
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng_state)

    def attn_branch(self, x, segment_ids=None):
        return self.attn(self.attn_norm(x), segment_ids)

    def mlp_branch(self, x):
        return self.mlp(self.mlp_norm(x))

    def _block(self, x, segment_ids=None):
        if self.activation_checkpointing == "selective":
            x = x + self._checkpointed(self.attn_branch, x, segment_ids)
            rows = mlp_tile_rows(self.mlp, x) if torch.is_grad_enabled() else None
            if rows is None:
                return x + self._checkpointed(self.mlp_branch, x)
            # A long sequence's MLP in tiles of its rows, each checkpointed alone: backward rebuilds one tile's
            # intermediates at a time, not the whole sequence's 4 f per token (row-wise: the same result).
            return x + torch.cat([self._checkpointed(self.mlp_branch, part) for part in x.split(rows, dim=1)], dim=1)
        x = x + self.attn_branch(x, segment_ids)
        return x + self.mlp_branch(x)

    def forward(self, x, segment_ids: Optional[torch.Tensor] = None):
        """x [b, s(/tp), h]; or, between pipeline stages, the tuple (x, segment_ids), returned as such."""
        if isinstance(x, tuple):
            hidden, seg = x
            return self.forward(hidden, seg), seg
        if self.activation_checkpointing == "full":
            return self._checkpointed(self._block, x, segment_ids)
        return self._block(x, segment_ids)


class SandwichBlock(Block):
    """Four norms, as transformers' Gemma2DecoderLayer: x + post(attn(pre(x))), then h + post(mlp(pre(h)))."""

    def __init__(self, cfg, layer_idx: int, tp=None, sequence_parallel: bool = False,
                 activation_checkpointing: str = "none", preserve_rng_state: bool = False, seed: int = 0):
        super().__init__(cfg, layer_idx, tp, sequence_parallel, activation_checkpointing, preserve_rng_state, seed)
        dims = ModelShape.from_config(cfg)
        tp, sp = self.attn.tp, self.attn.sequence_parallel
        self.attn_post_norm = self.norm_class(dims.hidden_size, dims.norm_eps, tp, sp)
        self.mlp_post_norm = self.norm_class(dims.hidden_size, dims.norm_eps, tp, sp)

    def attn_branch(self, x, segment_ids=None):
        return self.attn_post_norm(self.attn(self.attn_norm(x), segment_ids))

    def mlp_branch(self, x):
        return self.mlp_post_norm(self.mlp(self.mlp_norm(x)))


class PostNormBlock(Block):
    """Each branch's output RMS-normalised before it joins the residual stream, no norm before the branches
    (transformers' Olmo2DecoderLayer: x + norm(attn(x)), then h + norm(mlp(h))). attn_norm / mlp_norm keep the
    pre-norm block's names (the checkpoint map says which norm each is)."""

    def attn_branch(self, x, segment_ids=None):
        return self.attn_norm(self.attn(x, segment_ids))

    def mlp_branch(self, x):
        return self.mlp_norm(self.mlp(x))
