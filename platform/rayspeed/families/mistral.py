"""Mistral (transformers' MistralForCausalLM): Llama's block; a sliding window rayspeed runs only when it covers
the whole training sequence."""

from __future__ import annotations

from typing import Any

from rayspeed.families.family import SLIDING_WINDOW_COVERS_SEQ, Family


def mistral_extras(num_layers: int) -> dict[str, Any]:
    return {"sliding_window": None}


FAMILY = Family(architectures=("MistralForCausalLM",), model_type="mistral",
                sliding_window=SLIDING_WINDOW_COVERS_SEQ, export_extras=mistral_extras)
