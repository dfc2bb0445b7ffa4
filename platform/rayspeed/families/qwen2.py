"""Qwen2 (transformers' Qwen2ForCausalLM): Llama's block with q/k/v biases (no output bias); with
`use_sliding_window`, the layers from `max_window_layers` on (or those config.json's `layer_types` names) attend
within `sliding_window`."""

from __future__ import annotations

from rayspeed.families.family import SLIDING_USE_FLAG, ConfigKeys, Family, llama_tensor_names, use_flag_extras

FAMILY = Family(architectures=("Qwen2ForCausalLM",), model_type="qwen2", tensor_names=llama_tensor_names(qkv_bias=True),
                keys=ConfigKeys(sliding_window=SLIDING_USE_FLAG), export_extras=use_flag_extras)
