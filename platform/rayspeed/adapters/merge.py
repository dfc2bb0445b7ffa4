"""Adapters folded into their base weights: the whole model a job with adapters exports as its model (what the
MLflow logged model and `--format hf` hold), the adapter itself going beside it in PEFT's files.

    W' = W + s B A                                  (LoRA, rsLoRA)
    W' = m / ||W + s B A||_rows * (W + s B A)       (DoRA; peft's merge)
"""

from __future__ import annotations

from typing import Any

import torch

from rayspeed.config import adapter as spec
from rayspeed.config.adapter import is_adapter


def adapted_layers(state: dict[str, Any]) -> list[str]:
    return sorted({n.partition(".adapter.")[0] for n in state if is_adapter(n)})


def merged(state: dict[str, torch.Tensor], adapter: Any, family: Any = None) -> dict[str, torch.Tensor]:
    """`state` (whole tensors) with every adapter merged into its layer's weight and no adapter tensor left.
    family: the model's, whose fused projections' parts share their first part's A."""
    out = {n: t for n, t in state.items() if not is_adapter(n)}
    for layer in adapted_layers(state):
        s = spec.scale(adapter, spec.role_of(layer))
        w = out[f"{layer}.weight"]
        a = state.get(f"{layer}.adapter.lora_A")
        if a is None:
            a = state[f"{spec.a_owner(layer, family)}.adapter.lora_A"]
        new = w.double() + s * (state[f"{layer}.adapter.lora_B"].double() @ a.double())
        magnitude = state.get(f"{layer}.adapter.magnitude")
        if magnitude is not None:
            new = (magnitude.double() / new.norm(dim=1))[:, None] * new
        out[f"{layer}.weight"] = new.to(w.dtype)
    return out
