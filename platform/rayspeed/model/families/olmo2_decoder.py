"""OLMo 2's decoder, as transformers' Olmo2DecoderLayer computes it: each branch's output RMS-normalised before it
joins the residual stream (the weight applied in fp32), q and k normalised over their whole projections before
RoPE."""

from __future__ import annotations

from rayspeed.families import olmo2
from rayspeed.model.families import Composition
from rayspeed.model.parts.blocks import PostNormBlock
from rayspeed.model.parts.norms import Fp32WeightRMSNorm
from rayspeed.model.parts.self_attention import ProjectionNormAttention


class Olmo2Block(PostNormBlock):
    attention_class = ProjectionNormAttention
    norm_class = Fp32WeightRMSNorm


MODEL = Composition(families=(olmo2.FAMILY,), block=Olmo2Block, norm=Fp32WeightRMSNorm)
