"""DeepSeek-V3 (transformers' DeepseekV3ForCausalLM: DeepSeek-V3, V3.1, R1 and the checkpoints on its architecture
that name it, e.g. Moonlight): multi-head latent attention, whose queries come through a low-rank projection and its
norm (`q_lora_rank`; null: one projection) and whose keys and values come from one shared latent of `kv_lora_rank`
(normed) beside one RoPE part shared by every head (`qk_rope_head_dim`; interleaved pairs with `rope_interleave`), up-
projected per head into `qk_nope_head_dim` keys and `v_head_dim` values; the first `first_k_dense_replace` layers
dense (intermediate_size), the others `n_routed_experts` SwiGLU experts of width moe_intermediate_size beside
`n_shared_experts` always-on ones, routed by sigmoid scores: the group-limited top k (the `n_group` groups with the
best two corrected scores each, `topk_group` of them) of the scores plus `e_score_correction_bias`, weighted by the
uncorrected scores, renormalised with `norm_topk_prob` and times `routed_scaling_factor`
(model/families/deepseek_v3_decoder.py). transformers adds no balance loss for it, so neither does rayspeed by
default (router_aux_loss_coef 0). The published checkpoints' FP8 weights with their 128 x 128 block scales
(`weight_scale_inv`) are read dequantized (model/hf_weights.py)."""

from __future__ import annotations

from typing import Any, Optional

from rayspeed.families.family import (
    HEAD_DIM_KEY,
    AttentionForm,
    ConfigKeys,
    ExpertKeys,
    Family,
    TensorNames,
    frozen,
    llama_tensor_names,
)

OWN_KEYS = frozen({"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                   "v_head_dim": 128, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                   "n_shared_experts": 1, "rope_interleave": True})


def deepseek_v3_tensor_names() -> TensorNames:
    base = llama_tensor_names()
    in_layer: dict[str, tuple[str, Optional[int]]] = dict(base.in_layer)
    in_layer.update({
        "attn.wq_a.weight": ("self_attn.q_a_proj.weight", None),
        "attn.q_a_norm.weight": ("self_attn.q_a_layernorm.weight", None),
        "attn.wq_b.weight": ("self_attn.q_b_proj.weight", 0),
        "attn.wkv_a.weight": ("self_attn.kv_a_proj_with_mqa.weight", None),
        "attn.kv_a_norm.weight": ("self_attn.kv_a_layernorm.weight", None),
        "attn.wkv_b.weight": ("self_attn.kv_b_proj.weight", 0),
        "mlp.router.weight": ("mlp.gate.weight", None),
        "mlp.router.score_bias": ("mlp.gate.e_score_correction_bias", None),
        "mlp.shared.w_gate.weight": ("mlp.shared_experts.gate_proj.weight", 0),
        "mlp.shared.w_up.weight": ("mlp.shared_experts.up_proj.weight", 0),
        "mlp.shared.w_down.weight": ("mlp.shared_experts.down_proj.weight", 1)})
    experts = {"mlp.w_gate": ("mlp.experts.{e}.gate_proj.weight", 0), "mlp.w_up": ("mlp.experts.{e}.up_proj.weight", 0),
               "mlp.w_down": ("mlp.experts.{e}.down_proj.weight", 1)}
    return TensorNames(top=base.top, in_layer=frozen(in_layer), experts=frozen(experts))


def own(shape: Any, key: str) -> Any:
    return shape.family_key(key)


def latent_attention_params(shape: Any) -> dict[str, tuple[int, ...]]:
    h, heads = shape.hidden_size, shape.num_heads
    q_rank, kv_rank = own(shape, "q_lora_rank"), own(shape, "kv_lora_rank")
    nope, rope, v = own(shape, "qk_nope_head_dim"), own(shape, "qk_rope_head_dim"), own(shape, "v_head_dim")
    if q_rank:
        out = {"attn.wq_a.weight": (q_rank, h), "attn.q_a_norm.weight": (q_rank,),
               "attn.wq_b.weight": (heads * (nope + rope), q_rank)}
    else:
        out = {"attn.wq.weight": (heads * (nope + rope), h)}
    out.update({"attn.wkv_a.weight": (kv_rank + rope, h), "attn.kv_a_norm.weight": (kv_rank,),
                "attn.wkv_b.weight": (heads * (nope + v), kv_rank), "attn.wo.weight": (h, heads * v)})
    return out


def shared_experts_width(shape: Any) -> int:
    return shape.expert_ffn_hidden_size * int(own(shape, "n_shared_experts"))


def deepseek_v3_layer_params(shape: Any, layer: int) -> dict[str, tuple[int, ...]]:
    if not shape.is_moe(layer):
        return {}
    h, fs = shape.hidden_size, shared_experts_width(shape)
    return {"mlp.router.score_bias": (shape.num_experts,), "mlp.shared.w_gate.weight": (fs, h),
            "mlp.shared.w_up.weight": (fs, h), "mlp.shared.w_down.weight": (h, fs)}


def moe_extras(shape: Any) -> dict[str, Any]:
    """The config.json keys of DeepSeek-V3's mixture of experts (GLM-4.5's too); no MTP layers are exported."""
    return {"n_routed_experts": shape.num_experts, "num_experts_per_tok": shape.experts_per_token,
            "moe_intermediate_size": shape.expert_ffn_hidden_size, "norm_topk_prob": shape.norm_topk_prob,
            "first_k_dense_replace": min(shape.moe_layers, default=shape.num_layers), "num_nextn_predict_layers": 0}


def deepseek_v3_extras(shape: Any) -> dict[str, Any]:
    return {**moe_extras(shape), "qk_head_dim": own(shape, "qk_nope_head_dim") + own(shape, "qk_rope_head_dim"),
            "head_dim": own(shape, "qk_rope_head_dim"), "attention_bias": False}


FAMILY = Family(architectures=("DeepseekV3ForCausalLM",), model_type="deepseek_v3",
                tensor_names=deepseek_v3_tensor_names(),
                defaults=frozen({"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                                 "norm_topk_prob": True, "router_aux_loss_coef": 0.0}),
                keys=ConfigKeys(optional=(HEAD_DIM_KEY,), own=OWN_KEYS), export_extras=deepseek_v3_extras,
                moe=ExpertKeys(experts="n_routed_experts", expert_ffn="moe_intermediate_size",
                               norm_topk="norm_topk_prob", first_dense="first_k_dense_replace"),
                layer_params=deepseek_v3_layer_params, attention=AttentionForm(params=latent_attention_params))
