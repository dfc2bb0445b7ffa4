"""Llama (transformers' LlamaForCausalLM): the model rayspeed's decoder is."""

from __future__ import annotations

from typing import Any

from rayspeed.families.family import Family


def llama_extras(shape: Any) -> dict[str, Any]:
    return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}


FAMILY = Family(architectures=("LlamaForCausalLM",), model_type="llama",
                export_extras=llama_extras)
