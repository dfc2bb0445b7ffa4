"""Adapters in PEFT's files: rayspeed's adapter names <-> peft's keys, and the adapter_config.json peft reads.

    layers.0.attn.wq.adapter.lora_A    <->  base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
    layers.0.attn.wq.adapter.lora_B    <->  base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight
    layers.0.attn.wq.adapter.magnitude <->  base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector

The base module path comes from the family's checkpoint names (TensorNames), so every family maps the same way.
`peft.PeftModel.from_pretrained(base, folder)` loads what write_peft_dir writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from rayspeed.config import adapter as spec
from rayspeed.config.adapter import PEFT_PREFIX as PREFIX
from rayspeed.config.adapter import full_module_name, fully_trained, is_adapter

_PEFT_SUFFIX = {"lora_A": "lora_A.weight", "lora_B": "lora_B.weight", "magnitude": "lora_magnitude_vector"}
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def peft_key(name: str, shape: Any) -> str:
    """peft's key of rayspeed adapter parameter `name`."""
    layer, _, kind = name.partition(".adapter.")
    hf = shape.family.tensor_names.hf_name(f"{layer}.weight")
    return PREFIX + hf[: -len(".weight")] + "." + _PEFT_SUFFIX[kind]


def rayspeed_name(key: str, shape: Any) -> Optional[str]:
    """rayspeed's adapter parameter of peft key `key` (None: not an adapter key rayspeed knows)."""
    if not key.startswith(PREFIX):
        return None
    rest = key[len(PREFIX):]
    for kind, suffix in _PEFT_SUFFIX.items():
        if rest.endswith("." + suffix):
            layer = shape.family.tensor_names.rayspeed_name(rest[: -len(suffix)] + "weight")
            return None if layer is None else f"{layer[: -len('.weight')]}.adapter.{kind}"
    return None


def leaf_name(role: str, shape: Any) -> str:
    """The leaf name of the checkpoint's module role `role` names (q -> q_proj, ...)."""
    return shape.family.tensor_names.hf_name(f"layers.0.{spec.ROLES[role]}.weight").split(".")[-2]


def target_modules(adapter: Any, shape: Any) -> list[str]:
    """peft's target_modules: the leaf names of the checkpoint's modules the roles name (q_proj, ...; a fused
    projection once; the MLP's only where a block has a dense one)."""
    return list(dict.fromkeys(leaf_name(r, shape) for r in spec.target_roles(adapter) if spec.role_layers(shape, r)))


def _part(name: str, shape: Any) -> tuple[str, tuple[str, ...]]:
    """(the layer of adapter parameter `name`, the layers its checkpoint projection stacks: () unless fused)."""
    layer = name.partition(".adapter.")[0]
    names = shape.family.tensor_names
    parts = names.fused_parts(names.hf_name(f"{layer}.weight"))
    return layer, tuple(p[: -len(".weight")] for p in parts)


def patterns(adapter: Any, shape: Any) -> dict[str, dict[str, Any]]:
    """peft's rank_pattern and alpha_pattern (keys: the projections' leaf names, which peft matches as the last
    part of a module's name)."""
    return {key: {leaf_name(r, shape): v for r, v in (getattr(adapter, key, None) or {}).items()}
            for key in ("rank_pattern", "alpha_pattern")}


def modules_to_save(adapter: Any, shape: Any) -> Optional[list[str]]:
    """peft's modules_to_save: the leaf names of the checkpoint's modules that train in full (embed_tokens, lm_head,
    the norms), or None."""
    from rayspeed.config.hf_checkpoint import param_shapes

    leaves = {shape.family.tensor_names.hf_name(n)[: -len(".weight")].split(".")[-1]
              for n in param_shapes(shape) if fully_trained(n, adapter, shape)}
    return sorted(leaves) or None


def adapter_config(adapter: Any, shape: Any, base: str) -> dict[str, Any]:
    full = modules_to_save(adapter, shape)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": adapter.rank, "lora_alpha": adapter.alpha, "lora_dropout": adapter.dropout,
        "target_modules": target_modules(adapter, shape), "use_rslora": adapter.rslora, "use_dora": adapter.dora,
        "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": full, **patterns(adapter, shape),
        # A tied head trained in full is the embedding: peft ties lm_head to its trained copy.
        "ensure_weight_tying": bool(full and shape.tie_embeddings and "embed_tokens" in full),
    }


def peft_state(state: dict[str, torch.Tensor], shape: Any, adapter: Any = None) -> dict[str, torch.Tensor]:
    """The adapter tensors of a whole (unsharded) state dict under peft's keys, and those `adapter` trains in full
    (peft's modules_to_save, under the checkpoint's own names)."""
    out: dict[str, torch.Tensor] = {}
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    for n, t in state.items():
        if not is_adapter(n):
            continue
        key, (layer, parts) = peft_key(n, shape), _part(n, shape)
        if not parts or n.endswith(".lora_A"):  # a fused projection has one A: its parts share it
            out.setdefault(key, t.detach().contiguous())
        else:  # B and DoRA's magnitude: the parts' rows stacked as in the checkpoint's tensor
            stacked.setdefault(key, {})[parts.index(layer)] = t.detach()
    out.update({k: torch.cat([rows[i] for i in sorted(rows)], dim=0).contiguous() for k, rows in stacked.items()})
    if adapter is not None:
        names = shape.family.tensor_names
        out.update({PREFIX + names.hf_name(n): t.detach().contiguous()
                    for n, t in state.items() if not is_adapter(n) and fully_trained(n, adapter, shape)})
        if shape.tie_embeddings and fully_trained("embed.weight", adapter, shape) and "embed.weight" in state:
            out[PREFIX + names.hf_name("head.weight")] = out[PREFIX + names.hf_name("embed.weight")].clone()  # tie
    return out


def write_peft_dir(state: dict[str, torch.Tensor], adapter: Any, shape: Any, out: str, base: str) -> Path:
    """adapter_config.json + adapter_model.safetensors of the adapter in `state` (whole tensors), for base `base`
    (what peft records as base_model_name_or_path: a hub id or the directory the base was read from)."""
    from safetensors.torch import save_file

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(peft_state(state, shape, adapter), str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(adapter_config(adapter, shape, base), indent=2) + "\n")
    return folder


def load_peft_dir(model: torch.nn.Module, folder: str, shape: Any, tp: Any = None,
                  full_params: Optional[dict[str, torch.nn.Parameter]] = None) -> int:
    """Copy a PEFT adapter's tensors (adapter_model.safetensors; its settings checked against the job's before the
    launch: config.adapter.init_adapter_problems) into the adapters of `model` (a Transformer or a pipeline
    stage, adapters attached), each cut to this rank's shard; and its modules trained in full (peft's
    modules_to_save) into `full_params` (this rank's parameters by rayspeed name: those it holds get theirs, cut to
    its tp shard). Returns how many tensors were copied. ValueError names a tensor the model lacks or misses."""
    from safetensors.torch import load_file

    from rayspeed.adapters.attach import blocks

    saved = {}
    full: dict[str, torch.Tensor] = {}
    dims = spec.role_dims(shape)
    for key, t in load_file(str(Path(folder) / WEIGHTS_FILE)).items():
        name = rayspeed_name(key.replace(".default.", "."), shape)  # peft may keep the adapter name in a key
        if name is None:  # a module trained in full (modules_to_save), or nothing of this model
            whole = full_module_name(key, shape)
            if whole is None:
                raise ValueError(f"train.init_from {folder}: {key} is not a LoRA tensor of this model")
            full[whole] = t
            continue
        kind = name.partition(".adapter.")[2]
        parts = _part(name, shape)[1]
        if not parts:
            saved[name] = t
        elif kind == "lora_A":  # one A for the fused projection: its first part holds it, the others share it
            saved[f"{parts[0]}.adapter.lora_A"] = t
        else:  # its rows, part by part
            rows = [dims[spec.role_of(p)][1] for p in parts]
            saved.update({f"{p}.adapter.{kind}": v for p, v in zip(parts, t.split(rows, dim=0))})
    held = {f"{b.canonical_prefix}.{n}": p for b in blocks(model) for n, p in b.named_parameters() if is_adapter(n)}
    missing = sorted(set(held) - set(saved))
    if missing:
        raise ValueError(f"train.init_from {folder}: no tensor for {', '.join(missing[:4])}"
                         f"{' ...' if len(missing) > 4 else ''}")
    with torch.no_grad():
        for name, p in held.items():
            value, dim = saved[name], spec.partition_dim(name)
            if tp is not None and tp.enabled and dim is not None:
                value = value.chunk(tp.world_size, dim=dim)[tp.rank]
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"train.init_from {folder}: {name} is {tuple(value.shape)} for this rank, the "
                                 f"model's is {tuple(p.shape)}")
            p.copy_(value.to(device=p.device, dtype=p.dtype))
        copied = 0
        for name, p in (full_params or {}).items():
            if name not in full:
                continue
            value, dim = full[name], getattr(p, "partition_dim", None)
            if tp is not None and tp.enabled and getattr(p, "tensor_model_parallel", False) and dim is not None:
                value = value.chunk(tp.world_size, dim=dim)[tp.rank]
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"train.init_from {folder}: {name} (trained in full) is {tuple(value.shape)} for "
                                 f"this rank, the model's is {tuple(p.shape)}")
            p.copy_(value.to(device=p.device, dtype=p.dtype))
            copied += 1
    return len(held) + copied
