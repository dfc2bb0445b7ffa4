"""Qwen3's decoder (and Qwen3-MoE's): the Llama block whose attention RMS-normalises each query and key head before
RoPE, as transformers' Qwen3Attention does."""

from __future__ import annotations

from rayspeed.families import qwen3, qwen3_moe
from rayspeed.model.families import Composition
from rayspeed.model.parts.blocks import Block
from rayspeed.model.parts.self_attention import QKNormAttention


class Qwen3Block(Block):
    attention_class = QKNormAttention


MODEL = Composition(families=(qwen3.FAMILY, qwen3_moe.FAMILY), block=Qwen3Block)
