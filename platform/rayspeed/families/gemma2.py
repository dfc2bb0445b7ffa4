"""Gemma 2 (transformers' Gemma2ForCausalLM): Gemma's (1 + w) RMS norms, four per block, the embedding scaled by
sqrt(hidden), GeGLU, the attention scale query_pre_attn_scalar^-0.5, local sliding-window layers alternating with
global ones (one RoPE base for both), and soft-capping of the attention scores (50) and of the final logits (30);
tied embeddings (model/families/gemma2.py)."""

from __future__ import annotations

from typing import Any, Optional

from rayspeed.families.family import (
    HEAD_DIM_KEY,
    QUERY_SCALE_KEY,
    SLIDING_LAYER_TYPES,
    SOFTCAP_KEYS,
    ConfigKeys,
    Family,
    TensorNames,
    frozen,
    layer_types_of,
    llama_tensor_names,
)


def gemma2_tensor_names() -> TensorNames:
    """Gemma's four norms per block: before attention (the decoder's attn_norm), after it, before the MLP (the
    decoder's mlp_norm) and after it."""
    base = llama_tensor_names()
    in_layer: dict[str, tuple[str, Optional[int]]] = dict(base.in_layer)
    in_layer["mlp_norm.weight"] = ("pre_feedforward_layernorm.weight", None)
    in_layer["attn_post_norm.weight"] = ("post_attention_layernorm.weight", None)
    in_layer["mlp_post_norm.weight"] = ("post_feedforward_layernorm.weight", None)
    return TensorNames(top=base.top, in_layer=frozen(in_layer))


def gemma2_extras(shape: Any) -> dict[str, Any]:
    scalar = shape.query_pre_attn_scalar
    return {"hidden_activation": shape.hidden_act,
            # Gemma2Config is a strict dataclass whose query_pre_attn_scalar is an int.
            "query_pre_attn_scalar": int(scalar) if scalar and float(scalar).is_integer() else scalar,
            "sliding_window": shape.sliding_window, "layer_types": layer_types_of(shape),
            "attn_logit_softcapping": shape.attn_logit_softcapping,
            "final_logit_softcapping": shape.final_logit_softcapping, "attention_bias": False}


FAMILY = Family(architectures=("Gemma2ForCausalLM",), model_type="gemma2", tensor_names=gemma2_tensor_names(),
                defaults=frozen({"tie_word_embeddings": True, "rms_norm_eps": 1e-6,
                                 "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
                                 "sliding_window": 4096, "sliding_window_pattern": 2,
                                 "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
                keys=ConfigKeys(optional=(HEAD_DIM_KEY, *SOFTCAP_KEYS, QUERY_SCALE_KEY),
                                activation="hidden_activation", activations=("gelu_pytorch_tanh",),
                                sliding_window=SLIDING_LAYER_TYPES),
                export_extras=gemma2_extras, norms_keep_fp32=True)
