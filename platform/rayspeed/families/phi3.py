"""Phi-3 and Phi-4 (transformers' Phi3ForCausalLM; Phi-4 checkpoints are Phi3ForCausalLM too): Llama's block
whose checkpoint fuses q, k and v into `qkv_proj` and gate and up into `gate_up_proj` (split on load, each tp rank
reading only its rows of each part, and fused again on export); `sliding_window` on every layer (Phi-3-mini's
2047); longrope in the 128k models; partial rotary (Phi-4-mini: 0.75)."""

from __future__ import annotations

from typing import Any, Optional

from rayspeed.families.family import (
    PARTIAL_ROTARY_KEY,
    SLIDING_ALL_LAYERS,
    ConfigKeys,
    Family,
    TensorNames,
    frozen,
    llama_tensor_names,
)


def phi3_tensor_names() -> TensorNames:
    base = llama_tensor_names()
    in_layer: dict[str, tuple[str, Optional[int]]] = {
        k: v for k, v in base.in_layer.items() if not k.endswith(".bias")}
    for p in "qkv":
        in_layer[f"attn.w{p}.weight"] = ("self_attn.qkv_proj.weight", 0)
    in_layer["mlp.w_gate.weight"] = ("mlp.gate_up_proj.weight", 0)
    in_layer["mlp.w_up.weight"] = ("mlp.gate_up_proj.weight", 0)
    fused = {"self_attn.qkv_proj.weight": ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight"),
             "mlp.gate_up_proj.weight": ("mlp.w_gate.weight", "mlp.w_up.weight")}
    return TensorNames(top=base.top, in_layer=frozen(in_layer), fused=frozen(fused))


def phi3_extras(shape: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"sliding_window": shape.sliding_window, "attention_bias": False, "resid_pdrop": 0.0,
                           "embd_pdrop": 0.0, "partial_rotary_factor": shape.partial_rotary_factor}
    if shape.rope_original_max_positions:
        out["original_max_position_embeddings"] = shape.rope_original_max_positions
    return out


FAMILY = Family(architectures=("Phi3ForCausalLM",), model_type="phi3", tensor_names=phi3_tensor_names(),
                defaults=frozen({"tie_word_embeddings": False, "rms_norm_eps": 1e-5, "hidden_act": "silu"}),
                keys=ConfigKeys(optional=(PARTIAL_ROTARY_KEY,), sliding_window=SLIDING_ALL_LAYERS),
                export_extras=phi3_extras)
