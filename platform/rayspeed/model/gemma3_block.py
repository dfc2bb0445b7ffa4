"""Gemma 3's block, as transformers' Gemma3DecoderLayer computes it: Gemma 2's four (1 + w) norms per block
(model/gemma2_block.py) with per-head q/k norms before RoPE (model/qwen3_block.py's attention, in Gemma's style).
Its GeGLU, sliding windows, local RoPE base, attention scale and scaled embedding are the decoder's, read from the
shape."""

from __future__ import annotations

from rayspeed.model import gemma2_block
from rayspeed.model.qwen3_block import QKNormAttention


class Block(gemma2_block.Block):
    attention_class = QKNormAttention
