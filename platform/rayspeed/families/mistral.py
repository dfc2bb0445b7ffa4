"""Mistral (transformers' MistralForCausalLM): Llama's block; config.json's `sliding_window` (Mistral-7B-v0.1: 4096)
applies to every layer, as transformers' MistralModel applies it."""

from __future__ import annotations

from typing import Any

from rayspeed.families.family import SLIDING_ALL_LAYERS, ConfigKeys, Family


def mistral_extras(shape: Any) -> dict[str, Any]:
    return {"sliding_window": shape.sliding_window}


FAMILY = Family(architectures=("MistralForCausalLM",), model_type="mistral",
                keys=ConfigKeys(sliding_window=SLIDING_ALL_LAYERS), export_extras=mistral_extras)
