"""Gemma 3, text only (transformers' Gemma3ForCausalLM, model_type gemma3_text): Gemma's (1 + w) RMS norms, four
per block (before and after attention and the MLP), per-head q/k norms, the embedding scaled by sqrt(hidden),
GeGLU with tanh-approximated GELU, the attention scale query_pre_attn_scalar^-0.5, and local layers attending
within `sliding_window` with their own RoPE base (five local to one global in the released models); tied
embeddings (model/families/gemma3.py)."""

from __future__ import annotations

from typing import Any, Optional

from rayspeed.families.family import (
    HEAD_DIM_KEY,
    LOCAL_ROPE_KEY,
    QUERY_SCALE_KEY,
    SLIDING_LAYER_TYPES,
    ConfigKeys,
    Family,
    TensorNames,
    frozen,
)
from rayspeed.families.gemma2 import gemma2_extras, gemma2_tensor_names


def gemma3_tensor_names() -> TensorNames:
    base = gemma2_tensor_names()
    in_layer: dict[str, tuple[str, Optional[int]]] = dict(base.in_layer)
    in_layer["attn.q_norm.weight"] = ("self_attn.q_norm.weight", None)  # one head's width: whole on every tp rank
    in_layer["attn.k_norm.weight"] = ("self_attn.k_norm.weight", None)
    return TensorNames(top=base.top, in_layer=frozen(in_layer))


def gemma3_extras(shape: Any) -> dict[str, Any]:
    """Gemma 2's keys, with one RoPE per layer type (the local layers' base) and no soft-capping."""
    full: dict[str, Any] = {"rope_type": shape.rope_type, "rope_theta": shape.rope_theta}
    full.update({k: v for k, v in (shape.rope_scaling or {}).items() if k != "rope_type"})
    local = {"rope_type": "default", "rope_theta": shape.rope_local_theta or shape.rope_theta}
    return {**gemma2_extras(shape), "rope_parameters": {"full_attention": full, "sliding_attention": local},
            "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False}


FAMILY = Family(architectures=("Gemma3ForCausalLM",), model_type="gemma3_text", tensor_names=gemma3_tensor_names(),
                defaults=frozen({"tie_word_embeddings": True, "rms_norm_eps": 1e-6,
                                 "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
                                 "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                                 "sliding_window": 4096, "sliding_window_pattern": 6}),
                keys=ConfigKeys(optional=(HEAD_DIM_KEY, QUERY_SCALE_KEY, LOCAL_ROPE_KEY),
                                activation="hidden_activation", activations=("gelu_pytorch_tanh",),
                                sliding_window=SLIDING_LAYER_TYPES),
                multimodal=("Gemma3ForConditionalGeneration",), export_extras=gemma3_extras, norms_keep_fp32=True)
