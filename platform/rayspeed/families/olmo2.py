"""OLMo 2 (transformers' Olmo2ForCausalLM): norms after attention and after the MLP instead of before them (each
branch's output is normalised before it joins the residual stream; no input norm), and RMS norms over the whole q
and k projections (a weight of heads x head_dim, not per head) before RoPE (model/families/olmo2.py)."""

from __future__ import annotations

from typing import Any, Optional

from rayspeed.families.family import (
    Family,
    TensorNames,
    frozen,
    llama_tensor_names,
)


def olmo2_tensor_names() -> TensorNames:
    base = llama_tensor_names()
    in_layer: dict[str, tuple[str, Optional[int]]] = dict(base.in_layer)
    # The block's two norms are its post-norms: the attention branch's output, then the MLP's.
    in_layer["attn_norm.weight"] = ("post_attention_layernorm.weight", None)
    in_layer["mlp_norm.weight"] = ("post_feedforward_layernorm.weight", None)
    # Over the whole projection: split by tp with the heads the rank owns, like the projection's rows.
    in_layer["attn.q_norm.weight"] = ("self_attn.q_norm.weight", 0)
    in_layer["attn.k_norm.weight"] = ("self_attn.k_norm.weight", 0)
    return TensorNames(top=base.top, in_layer=frozen(in_layer))


def olmo2_extras(shape: Any) -> dict[str, Any]:
    return {"attention_bias": False}


FAMILY = Family(architectures=("Olmo2ForCausalLM",), model_type="olmo2", tensor_names=olmo2_tensor_names(),
                defaults=frozen({"tie_word_embeddings": False, "rms_norm_eps": 1e-5, "hidden_act": "silu"}),
                export_extras=olmo2_extras, norms_keep_fp32=True)
