"""Adapters onto a built model (its weights loaded): freeze it and put a LoraAdapter beside every targeted linear
layer of every block this rank holds. (The engine's `adapters` transform calls it, then lets the parameters
`model.adapter.trainable` names train in full.)

Adapter parameters are named `<base layer>.adapter.lora_A` / `.lora_B` / `.magnitude` beside the unchanged base
names, so the base's loading, sharding and export are the same as without adapters.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch.nn as nn

from rayspeed.adapters.lora import LoraAdapter
from rayspeed.config import adapter as spec
from rayspeed.parallel.layers import NO_TP, ColumnParallelLinear, RowParallelLinear, dense_weight


def blocks(model: nn.Module) -> Iterator[nn.Module]:
    """The transformer blocks this rank holds (the Transformer's, or this pipeline stage's)."""
    return (m for m in model.modules() if hasattr(m, "canonical_prefix") and hasattr(m, "layer_idx"))


def add_adapters(model: nn.Module, adapter: Any, tp: Any = None, sequence_parallel: bool = False,
                 seed: int = 0) -> list[str]:
    """Freeze `model` and add the adapters `adapter` (a model.adapter section) asks for; returns the names of the
    adapted layers (rayspeed's, e.g. layers.0.attn.wq). The parts of a fused checkpoint projection (the block's
    family's: Phi-3's qkv_proj) share one A, as peft's one adapter on it (config.adapter)."""
    tp = tp or NO_TP
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = []
    for block in blocks(model):
        for role in spec.target_roles(adapter):
            path = spec.ROLES[role]
            if role in spec.MLP_ROLES and getattr(block, "in_moe_model", False):
                continue  # no MLP of a mixture of experts is adapted (config.adapter says why)
            layer = block.get_submodule(path)
            if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                raise TypeError(f"{block.canonical_prefix}.{path} is a {type(layer).__name__}, not a parallel linear")
            name = f"{block.canonical_prefix}.{path}"
            weight = dense_weight(layer)  # DoRA's magnitude starts from it (peft: the dequantized 4-bit one)
            dtype = layer.weight.dtype if layer.quantized is None else layer.quantized.dtype
            layer.adapter = LoraAdapter(
                layer.in_features, layer.out_features, isinstance(layer, RowParallelLinear), tp,
                rank=spec.role_rank(adapter, role), scale=spec.scale(adapter, role), dropout=adapter.dropout,
                dora=adapter.dora,
                sequence_parallel=sequence_parallel, seed=seed, name=f"{name}.adapter", weight=weight,
            ).to(device=weight.device, dtype=dtype)
            adapted.append(name)
        # One peft adapter per fused projection: one A for its parts.
        for group in spec.fused_groups(getattr(block, "family", None)).values():
            if group[0] in spec.target_roles(adapter):
                first = block.get_submodule(spec.ROLES[group[0]]).adapter
                for role in group[1:]:
                    block.get_submodule(spec.ROLES[role]).adapter.lora_A = first.lora_A
        if adapter.dropout > 0:
            block.preserve_rng_state = True  # recomputation must draw the same dropout masks
    return adapted


def trainable_count(model: nn.Module) -> tuple[int, int]:
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
