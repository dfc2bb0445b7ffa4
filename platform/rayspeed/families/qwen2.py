"""Qwen2 (transformers' Qwen2ForCausalLM): Llama's block with q/k/v biases (no output bias); with
`use_sliding_window`, the layers from `max_window_layers` on (or those config.json's `layer_types` names) attend
within `sliding_window`."""

from __future__ import annotations

from rayspeed.families.family import SLIDING_USE_FLAG, Family, use_flag_extras

FAMILY = Family(architectures=("Qwen2ForCausalLM",), model_type="qwen2",
                qkv_bias=True, sliding_window=SLIDING_USE_FLAG, export_extras=use_flag_extras)
