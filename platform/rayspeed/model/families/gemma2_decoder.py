"""Gemma 2's decoder, as transformers' Gemma2DecoderLayer computes it: four (1 + w) norms per block (before and after
attention and the MLP), the embedding scaled by sqrt(hidden). Its GeGLU, sliding windows, attention scale and
soft-capping are the shape's values, which the shared parts read."""

from __future__ import annotations

from rayspeed.families import gemma2
from rayspeed.model.families import Composition
from rayspeed.model.parts.blocks import SandwichBlock
from rayspeed.model.parts.norms import OffsetRMSNorm


class Gemma2Block(SandwichBlock):
    norm_class = OffsetRMSNorm


MODEL = Composition(families=(gemma2.FAMILY,), block=Gemma2Block, norm=OffsetRMSNorm, embed_scale=True)
