"""Qwen3 (transformers' Qwen3ForCausalLM): Llama's block with per-head RMS norms on q and k before RoPE
(model/qwen3_block.py), config.json's head_dim (128 in the released models, not hidden / heads), no q/k/v biases;
its sliding window must be off."""

from __future__ import annotations

from typing import Any, Optional

from rayspeed.families.family import (
    HEAD_DIM_FROM_CONFIG,
    SLIDING_FLAG_OFF,
    Family,
    TensorNames,
    frozen,
    llama_tensor_names,
)


def qwen3_tensor_names() -> TensorNames:
    base = llama_tensor_names()
    in_layer: dict[str, tuple[str, Optional[int]]] = dict(base.in_layer)
    in_layer["attn.q_norm.weight"] = ("self_attn.q_norm.weight", None)  # one head's width: whole on every tp rank
    in_layer["attn.k_norm.weight"] = ("self_attn.k_norm.weight", None)
    return TensorNames(top=base.top, in_layer=frozen(in_layer))


def qwen3_extras(num_layers: int) -> dict[str, Any]:
    return {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": num_layers, "layer_types": ["full_attention"] * num_layers}


FAMILY = Family(architectures=("Qwen3ForCausalLM",), model_type="qwen3", tensor_names=qwen3_tensor_names(),
                head_dim_rule=HEAD_DIM_FROM_CONFIG, qk_norm=True, sliding_window=SLIDING_FLAG_OFF,
                export_extras=qwen3_extras, block_module="qwen3_block")
