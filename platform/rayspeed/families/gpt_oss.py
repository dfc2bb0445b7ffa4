"""gpt-oss (transformers' GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b): grouped-query attention with biases on q, k,
v and o and a learned sink logit per head, sliding-window and full layers alternating (`layer_types`), yarn RoPE; in
every layer a mixture of `num_local_experts` experts, the router with a bias, the top-`num_experts_per_tok` logits
softmaxed (the same weights as the top k of the softmax renormalised), each expert a SwiGLU with biases whose gate is
clamped above and its linear part on both sides at `swiglu_limit`, gate * sigmoid(alpha * gate) * (up + 1)
(model/families/gpt_oss_decoder.py).

The checkpoints hold every expert of a layer in one tensor, [experts, in, out], gate and up interleaved in
gate_up_proj's columns (gate even, up odd); the published ones pack those two matrices in MXFP4 (`_blocks`: two 4-bit
values a byte, 32 a block; `_scales`: a power of two per block, biased by 127), which a load dequantizes; an export
writes the unpacked form (bf16 or the job's precision), as transformers' own save does after dequantizing."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from rayspeed.families.family import (
    HEAD_DIM_KEY,
    SLIDING_LAYER_TYPES,
    AttentionForm,
    ConfigKeys,
    ExpertKeys,
    Family,
    StoredForms,
    TensorNames,
    frozen,
    layer_types_of,
    llama_tensor_names,
)

MXFP4_BLOCK = 32  # values per scale
PACKED = 16  # bytes a block takes
EXPERTS = "mlp.experts."
# rayspeed's expert stacks -> (the checkpoint tensor holding them, the tp dimension of rayspeed's stack)
STACKS: Mapping[str, tuple[str, Optional[int]]] = frozen({
    "mlp.w_gate": ("gate_up_proj", 1), "mlp.w_up": ("gate_up_proj", 1), "mlp.w_down": ("down_proj", 2),
    "mlp.b_gate": ("gate_up_proj_bias", 1), "mlp.b_up": ("gate_up_proj_bias", 1),
    "mlp.b_down": ("down_proj_bias", None)})


def gpt_oss_tensor_names() -> TensorNames:
    base = llama_tensor_names(qkv_bias=True)
    in_layer: dict[str, tuple[str, Optional[int]]] = dict(base.in_layer)
    in_layer.update({"attn.wo.bias": ("self_attn.o_proj.bias", None), "attn.sinks": ("self_attn.sinks", 0),
                     "mlp.router.weight": ("mlp.router.weight", None), "mlp.router.bias": ("mlp.router.bias", None)})
    in_layer.update({name: (EXPERTS + hf, dim) for name, (hf, dim) in STACKS.items()})
    return TensorNames(top=base.top, in_layer=frozen(in_layer))


def gpt_oss_layer_params(shape: Any, layer: int) -> dict[str, tuple[int, ...]]:
    h, e, f = shape.hidden_size, shape.num_experts, shape.expert_ffn_hidden_size
    out: dict[str, tuple[int, ...]] = {"attn.wo.bias": (h,), "attn.sinks": (shape.num_heads,)}
    if shape.is_moe(layer):
        out.update({"mlp.router.bias": (e,), "mlp.b_gate": (e, f), "mlp.b_up": (e, f), "mlp.b_down": (e, h)})
    return out


def converted(shape: Any) -> tuple[str, ...]:
    return tuple(f"layers.{i}.{name}" for i in range(shape.num_layers) if shape.is_moe(i) for name in STACKS)


def forms(shape: Any) -> tuple[Mapping[str, tuple[int, ...]], ...]:
    """The unpacked form (what transformers' save writes), then MXFP4 (the published checkpoints)."""
    h, e, f = shape.hidden_size, shape.num_experts, shape.expert_ffn_hidden_size
    plain: dict[str, tuple[int, ...]] = {}
    packed: dict[str, tuple[int, ...]] = {}
    for i in range(shape.num_layers):
        if not shape.is_moe(i):
            continue
        p = f"model.layers.{i}.{EXPERTS}"
        biases = {p + "gate_up_proj_bias": (e, 2 * f), p + "down_proj_bias": (e, h)}
        plain.update({p + "gate_up_proj": (e, h, 2 * f), p + "down_proj": (e, f, h), **biases})
        packed.update({p + "gate_up_proj_blocks": (e, 2 * f, h // MXFP4_BLOCK, PACKED),
                       p + "gate_up_proj_scales": (e, 2 * f, h // MXFP4_BLOCK),
                       p + "down_proj_blocks": (e, h, f // MXFP4_BLOCK, PACKED),
                       p + "down_proj_scales": (e, h, f // MXFP4_BLOCK), **biases})
    return (frozen(plain), frozen(packed))


def gpt_oss_extras(shape: Any) -> dict[str, Any]:
    return {"num_local_experts": shape.num_experts, "num_experts_per_tok": shape.experts_per_token,
            "router_aux_loss_coef": shape.router_aux_loss_coef, "output_router_logits": False,
            "sliding_window": shape.sliding_window, "layer_types": layer_types_of(shape), "attention_bias": True}


FAMILY = Family(architectures=("GptOssForCausalLM",), model_type="gpt_oss", tensor_names=gpt_oss_tensor_names(),
                defaults=frozen({"tie_word_embeddings": False, "rms_norm_eps": 1e-5, "hidden_act": "silu",
                                 "rope_theta": 150_000.0, "sliding_window": 128, "sliding_window_pattern": 2}),
                keys=ConfigKeys(optional=(HEAD_DIM_KEY,), sliding_window=SLIDING_LAYER_TYPES,
                                own=frozen({"swiglu_alpha": 1.702, "swiglu_limit": 7.0})),
                export_extras=gpt_oss_extras, moe=ExpertKeys(experts="num_local_experts"),
                layer_params=gpt_oss_layer_params, attention=AttentionForm(sinks=True),
                stored=StoredForms(converted=converted, forms=forms))
