"""Qwen2 (transformers' Qwen2ForCausalLM): Llama's block with q/k/v biases (no output bias); its sliding window
must be off."""

from __future__ import annotations

from typing import Any

from rayspeed.families.family import SLIDING_FLAG_OFF, Family


def qwen2_extras(num_layers: int) -> dict[str, Any]:
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": num_layers,
            "layer_types": ["full_attention"] * num_layers}


FAMILY = Family(architectures=("Qwen2ForCausalLM",), model_type="qwen2",
                qkv_bias=True, sliding_window=SLIDING_FLAG_OFF, export_extras=qwen2_extras)
