"""Mixtral (transformers' MixtralForCausalLM: Mixtral-8x7B, 8x22B): Mistral's attention and, in every layer, a
mixture of `num_local_experts` SwiGLU experts of width intermediate_size with top-`num_experts_per_tok` routing,
always renormalised (model/moe.py). The hub's checkpoints name the block `block_sparse_moe` and the experts' matrices
w1 (gate), w3 (up) and w2 (down). `router_jitter_noise` must be 0: parity with transformers needs the routing to be
a function of the weights and tokens."""

from __future__ import annotations

from typing import Any, Optional

from rayspeed.families.family import (
    SLIDING_ALL_LAYERS,
    ConfigKeys,
    ExpertKeys,
    Family,
    TensorNames,
    frozen,
    llama_tensor_names,
)


def mixtral_tensor_names() -> TensorNames:
    base = llama_tensor_names()
    in_layer: dict[str, tuple[str, Optional[int]]] = dict(base.in_layer)
    in_layer["mlp.router.weight"] = ("block_sparse_moe.gate.weight", None)
    experts = {"mlp.w_gate": ("block_sparse_moe.experts.{e}.w1.weight", 0),
               "mlp.w_up": ("block_sparse_moe.experts.{e}.w3.weight", 0),
               "mlp.w_down": ("block_sparse_moe.experts.{e}.w2.weight", 1)}
    return TensorNames(top=base.top, in_layer=frozen(in_layer), experts=frozen(experts))


def mixtral_extras(shape: Any) -> dict[str, Any]:
    return {"sliding_window": shape.sliding_window, "num_local_experts": shape.num_experts,
            "num_experts_per_tok": shape.experts_per_token, "router_aux_loss_coef": shape.router_aux_loss_coef,
            "router_jitter_noise": 0.0, "output_router_logits": False}


FAMILY = Family(architectures=("MixtralForCausalLM",), model_type="mixtral", tensor_names=mixtral_tensor_names(),
                defaults=frozen({"tie_word_embeddings": False, "rms_norm_eps": 1e-5, "hidden_act": "silu"}),
                keys=ConfigKeys(sliding_window=SLIDING_ALL_LAYERS), export_extras=mixtral_extras,
                moe=ExpertKeys(experts="num_local_experts"))
