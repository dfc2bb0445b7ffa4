"""Qwen3 (transformers' Qwen3ForCausalLM): Llama's block with per-head RMS norms on q and k before RoPE
(model/families/qwen3.py), config.json's head_dim (128 in the released models, not hidden / heads), no q/k/v biases;
a sliding window as Qwen2's (`use_sliding_window`, `max_window_layers`)."""

from __future__ import annotations

from typing import Any, Optional

from rayspeed.families.family import (
    HEAD_DIM_KEY,
    SLIDING_USE_FLAG,
    ConfigKeys,
    Family,
    TensorNames,
    frozen,
    llama_tensor_names,
    use_flag_extras,
)


def qwen3_tensor_names() -> TensorNames:
    base = llama_tensor_names()
    in_layer: dict[str, tuple[str, Optional[int]]] = dict(base.in_layer)
    in_layer["attn.q_norm.weight"] = ("self_attn.q_norm.weight", None)  # one head's width: whole on every tp rank
    in_layer["attn.k_norm.weight"] = ("self_attn.k_norm.weight", None)
    return TensorNames(top=base.top, in_layer=frozen(in_layer))


def qwen3_extras(shape: Any) -> dict[str, Any]:
    return {"attention_bias": False, **use_flag_extras(shape)}


FAMILY = Family(architectures=("Qwen3ForCausalLM",), model_type="qwen3", tensor_names=qwen3_tensor_names(),
                keys=ConfigKeys(optional=(HEAD_DIM_KEY,), sliding_window=SLIDING_USE_FLAG), export_extras=qwen3_extras)
