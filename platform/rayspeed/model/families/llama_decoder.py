"""Llama's decoder, the one Mistral, Mixtral, Phi-3 and Qwen2 run as well (their differences are data: windows,
biases, fused tensors, partial RoPE, experts): pre-norm blocks, RMS norms with the weight after the cast, SwiGLU or
a mixture of experts."""

from __future__ import annotations

from rayspeed.families import llama
from rayspeed.model.families import Composition

MODEL = Composition(families=(llama.FAMILY,))
