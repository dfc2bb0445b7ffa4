"""GLM-4.5 (transformers' Glm4MoeForCausalLM: GLM-4.5, GLM-4.5-Air, GLM-4.6): grouped-query attention with q/k/v
biases, config.json's head_dim, RoPE over a share of each head (`partial_rotary_factor`, 0.5) and, with
`use_qk_norm`, per-head q/k RMS norms; the first `first_k_dense_replace` layers dense, the others DeepSeek-V3's
mixture: `n_routed_experts` experts routed by sigmoid scores (group-limited by `n_group` / `topk_group`, corrected by
`e_score_correction_bias`, times `routed_scaling_factor`) beside `n_shared_experts` shared ones
(model/families/glm4_moe_decoder.py composes the shared attention and DeepSeek-V3's MoE). transformers adds no
balance loss for it."""

from __future__ import annotations

from typing import Any, Optional

from rayspeed.families import deepseek_v3
from rayspeed.families.family import (
    HEAD_DIM_KEY,
    PARTIAL_ROTARY_KEY,
    AttentionForm,
    ConfigKeys,
    ExpertKeys,
    Family,
    TensorNames,
    frozen,
    llama_tensor_names,
)


def glm4_moe_tensor_names() -> TensorNames:
    base = deepseek_v3.deepseek_v3_tensor_names()  # its MoE's names; the attention's are Llama's, with biases
    in_layer: dict[str, tuple[str, Optional[int]]] = dict(base.in_layer)
    in_layer.update(llama_tensor_names(qkv_bias=True).in_layer)
    in_layer["attn.q_norm.weight"] = ("self_attn.q_norm.weight", None)  # one head's width: whole on every tp rank
    in_layer["attn.k_norm.weight"] = ("self_attn.k_norm.weight", None)
    return TensorNames(top=base.top, in_layer=frozen(in_layer), experts=base.experts)


def glm4_moe_attention_params(shape: Any) -> dict[str, tuple[int, ...]]:
    """The shared attention's q, k, v (with biases) and o, and the per-head q/k norms only with use_qk_norm."""
    h, q, kv = shape.hidden_size, shape.q_dim, shape.kv_dim
    out: dict[str, tuple[int, ...]] = {"attn.wq.weight": (q, h), "attn.wk.weight": (kv, h), "attn.wv.weight": (kv, h),
                                       "attn.wo.weight": (h, q), "attn.wq.bias": (q,), "attn.wk.bias": (kv,),
                                       "attn.wv.bias": (kv,)}
    if shape.family_key("use_qk_norm"):
        out.update({"attn.q_norm.weight": (shape.head_dim,), "attn.k_norm.weight": (shape.head_dim,)})
    return out


def glm4_moe_extras(shape: Any) -> dict[str, Any]:
    return {**deepseek_v3.moe_extras(shape), "partial_rotary_factor": shape.partial_rotary_factor,
            "attention_bias": True}


FAMILY = Family(architectures=("Glm4MoeForCausalLM",), model_type="glm4_moe", tensor_names=glm4_moe_tensor_names(),
                defaults=frozen({"tie_word_embeddings": False, "rms_norm_eps": 1e-5, "hidden_act": "silu",
                                 "norm_topk_prob": True, "router_aux_loss_coef": 0.0}),
                keys=ConfigKeys(optional=(HEAD_DIM_KEY, PARTIAL_ROTARY_KEY),
                                own=frozen({"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                                            "n_shared_experts": 1, "use_qk_norm": False})),
                export_extras=glm4_moe_extras,
                moe=ExpertKeys(experts="n_routed_experts", expert_ffn="moe_intermediate_size",
                               norm_topk="norm_topk_prob", first_dense="first_k_dense_replace"),
                layer_params=deepseek_v3.deepseek_v3_layer_params,
                attention=AttentionForm(params=glm4_moe_attention_params))
