"""Qwen3-MoE (transformers' Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k
norms, config.json's head_dim) and, on the layers `decoder_sparse_step` and `mlp_only_layers` leave sparse, a
mixture of `num_experts` SwiGLU experts of width `moe_intermediate_size` with top-`num_experts_per_tok` routing,
renormalised only with `norm_topk_prob` (model/moe.py); the other layers keep a dense MLP of intermediate_size."""

from __future__ import annotations

from typing import Any, Optional

from rayspeed.families.family import HEAD_DIM_KEY, SLIDING_USE_FLAG, ConfigKeys, ExpertKeys, Family, TensorNames, frozen
from rayspeed.families.qwen3 import qwen3_extras, qwen3_tensor_names


def qwen3_moe_tensor_names() -> TensorNames:
    base = qwen3_tensor_names()
    in_layer: dict[str, tuple[str, Optional[int]]] = dict(base.in_layer)
    in_layer["mlp.router.weight"] = ("mlp.gate.weight", None)
    experts = {"mlp.w_gate": ("mlp.experts.{e}.gate_proj.weight", 0), "mlp.w_up": ("mlp.experts.{e}.up_proj.weight", 0),
               "mlp.w_down": ("mlp.experts.{e}.down_proj.weight", 1)}
    return TensorNames(top=base.top, in_layer=frozen(in_layer), experts=frozen(experts))


def qwen3_moe_extras(shape: Any) -> dict[str, Any]:
    dense = [i for i in range(shape.num_layers) if not shape.is_moe(i)]
    return {**qwen3_extras(shape), "num_experts": shape.num_experts, "num_experts_per_tok": shape.experts_per_token,
            "moe_intermediate_size": shape.expert_ffn_hidden_size, "norm_topk_prob": shape.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": dense, "router_aux_loss_coef": shape.router_aux_loss_coef,
            "output_router_logits": False}


FAMILY = Family(architectures=("Qwen3MoeForCausalLM",), model_type="qwen3_moe", tensor_names=qwen3_moe_tensor_names(),
                keys=ConfigKeys(optional=(HEAD_DIM_KEY,), sliding_window=SLIDING_USE_FLAG),
                export_extras=qwen3_moe_extras,
                moe=ExpertKeys(experts="num_experts", expert_ffn="moe_intermediate_size", norm_topk="norm_topk_prob",
                               sparse_step="decoder_sparse_step", dense_layers="mlp_only_layers"))
