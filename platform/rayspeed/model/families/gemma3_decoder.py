"""Gemma 3's decoder, text only, as transformers' Gemma3DecoderLayer computes it: Gemma 2's sandwich of (1 + w) norms
with per-head q/k norms in the same style before RoPE, the embedding scaled by sqrt(hidden). Its local layers' RoPE
base, windows, GeGLU and attention scale are the shape's values, which the shared parts read."""

from __future__ import annotations

from rayspeed.families import gemma3
from rayspeed.model.families import Composition
from rayspeed.model.parts.blocks import SandwichBlock
from rayspeed.model.parts.norms import OffsetRMSNorm
from rayspeed.model.parts.self_attention import QKNormAttention


class Gemma3Attention(QKNormAttention):
    norm_class = OffsetRMSNorm


class Gemma3Block(SandwichBlock):
    attention_class = Gemma3Attention
    norm_class = OffsetRMSNorm


MODEL = Composition(families=(gemma3.FAMILY,), block=Gemma3Block, norm=OffsetRMSNorm, embed_scale=True)
