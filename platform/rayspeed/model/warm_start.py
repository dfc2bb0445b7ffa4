"""Warm start: initial weights from an exported rayspeed model (train.init_from); the optimizer starts fresh.

    model_dir = resolve_init_from("models:/rayspeed-tiny@champion", tracking_uri)   # rayspeed.tracking.model_fetch
    load_initial_weights(model, model_dir, tp=groups.tp, model_cfg=cfg.model)         # right after build_model

(rayspeed.engine.build.warm_start does both.)

`train.init_from` is one of
  * a local directory written by rayspeed.model.export.export_model (weights.pt + model_config.json);
  * models:/<name>@<alias> or models:/<name>/<version>: a registered version, downloaded with MLflow's artifact
    download into a per-version cache (versions are immutable, so a cached copy is reused; an alias is resolved
    to its version first). Several ranks on one machine download once (fcntl lock);
  * any other URI MLflow can download (runs:/<run_id>/model, s3://..., file://...).

weights.pt holds the full fp32 state_dict of rayspeed.model.transformer.Transformer. Each parameter of the
freshly built model (a whole Transformer, or one pipeline stage under the Transformer's canonical names) is
copied from it; under tensor parallelism each tensor is first cut to this rank's slice along the parameter's
`partition_dim` (the same chunking the layers' initialisation uses, so any tp degree loads any export).
model_config.json must describe the same architecture as the job's model section (seq_len and init_std may
differ: they do not shape the weights); otherwise a WarmStartError names the keys that differ.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Mapping, Optional

log = logging.getLogger(__name__)

WEIGHTS = "weights.pt"
CONFIG = "model_config.json"
COMPLETE = ".rayspeed-complete"

# Model keys that decide the weights or the function they compute; seq_len and init_std may change between a
# champion and its warm-started successor (RoPE tables are built per call, the init is overwritten).
ARCH_KEYS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
             "tie_embeddings", "rope_theta", "norm_eps", "qkv_bias", "rope_type", "rope_factor",
             "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_positions", "head_dim")


class WarmStartError(ValueError):
    """train.init_from cannot be used: missing, unreadable, or a different model."""


# ---------------------------------------------------------------- locating the model


def find_model_dir(root: Path) -> Optional[Path]:
    """The directory holding model_config.json: root itself, or the one folder below it that does; failing that,
    a Hugging Face model directory (config.json beside safetensors weights, e.g. `rayspeed export --format hf`)."""
    if (root / CONFIG).is_file():
        return root
    found = sorted(p.parent for p in root.rglob(CONFIG))
    if found:
        return found[0]
    hf = sorted(p.parent for p in root.rglob("config.json") if any(p.parent.glob("*.safetensors")))
    return hf[0] if hf else None


# ---------------------------------------------------------------- checking and loading


def _model_dict(model_cfg: Any) -> dict[str, Any]:
    """A model section (ModelConfig, a namespace or a mapping) with the optional sizes made concrete."""
    if dataclasses.is_dataclass(model_cfg) and not isinstance(model_cfg, type):
        d = dataclasses.asdict(model_cfg)
    elif isinstance(model_cfg, Mapping):
        d = dict(model_cfg)
    else:
        d = dict(vars(model_cfg))
    from rayspeed.config.shape import ModelShape

    dims = dataclasses.asdict(ModelShape.from_config(_NS(d)))
    return {k: dims.get(k, d.get(k)) for k in ARCH_KEYS}


class _NS:
    def __init__(self, d: dict[str, Any]):
        self.__dict__.update(d)


def read_model_config(model_dir: str) -> dict[str, Any]:
    try:
        with open(Path(model_dir) / CONFIG) as fh:
            spec = json.load(fh)
    except (OSError, ValueError) as e:
        raise WarmStartError(f"train.init_from: cannot read {Path(model_dir) / CONFIG} ({e})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise WarmStartError(f"train.init_from: {Path(model_dir) / CONFIG} has no 'model' section")
    return spec["model"]


def config_mismatches(saved_model: Mapping[str, Any], job_model: Any) -> list[str]:
    """'key: saved X, job Y' for every architecture key that differs (empty when compatible)."""
    a, b = _model_dict(saved_model), _model_dict(job_model)
    out = []
    for k in ARCH_KEYS:
        va, vb = a.get(k), b.get(k)
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and not isinstance(va, bool):
            same = float(va) == float(vb)
        else:
            same = va == vb
        if not same:
            out.append(f"model.{k}: saved {va!r}, job {vb!r}")
    return out


def check_compatible(model_dir: str, job_model: Any, spec: Optional[str] = None) -> None:
    bad = config_mismatches(read_model_config(model_dir), job_model)
    if bad:
        raise WarmStartError(f"train.init_from: {spec or model_dir} is a different model than this job's model section "
                             f"({'; '.join(bad)}); make the model section match it, or drop train.init_from to "
                             "train from scratch")


def _named_params(model: Any) -> tuple[list[tuple[str, Any]], bool]:
    """(Transformer name, parameter) for this rank's part of the model, and whether it is a pipeline stage."""
    from rayspeed.model.export import is_pipeline

    if is_pipeline(model):
        from rayspeed.model.decoder import canonical_named_parameters

        seen, out = set(), []
        for name, p in canonical_named_parameters(model):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
        return out, True
    return list(model.named_parameters()), False


def _slice_for_rank(full: Any, param: Any, tp: Any, name: str) -> Any:
    ws = int(getattr(tp, "world_size", 1) or 1) if tp is not None else 1
    if ws <= 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = getattr(param, "partition_dim", None)
    if dim is None:
        raise WarmStartError(f"train.init_from: parameter {name} is tensor-parallel but carries no partition_dim; "
                             "cannot cut the saved full tensor for this tp rank")
    if full.shape[dim] % ws:
        raise WarmStartError(f"train.init_from: {name}: dim {dim} of the saved tensor ({tuple(full.shape)}) does not "
                             f"divide by tp={ws}")
    return full.chunk(ws, dim=dim)[int(tp.rank)]


def load_initial_weights(model: Any, model_dir: str, tp: Any = None, model_cfg: Any = None) -> dict[str, Any]:
    """Copy weights.pt of model_dir into the freshly built `model` in place (before DeepSpeed wraps it).

    model: a rayspeed Transformer (tp shards included) or a pipeline stage. tp: the TensorParallel handle the
    model was built with (None or world_size 1: unsharded). model_cfg: the job's model section; when given,
    model_config.json must match it (WarmStartError naming the keys otherwise). Returns a small report
    {"model_dir", "parameters", "elements"}. Raises WarmStartError on a missing file, a missing or unexpected
    parameter, or a shape that does not fit.
    """
    import torch

    path = Path(model_dir)
    if model_cfg is not None:
        check_compatible(model_dir, model_cfg)
    wfile = path / WEIGHTS
    if not wfile.is_file():
        note = ""
        meta = path / "export.json"
        if meta.is_file():
            try:
                note = "; ".join(json.loads(meta.read_text()).get("limitations", []))
            except ValueError:
                pass
        raise WarmStartError(f"train.init_from: {wfile} missing{': ' + note if note else ''} (an incomplete export "
                             "cannot seed a warm start)")
    try:
        state = torch.load(wfile, map_location="cpu", weights_only=True)
    except Exception as e:
        raise WarmStartError(f"train.init_from: cannot load {wfile} ({type(e).__name__}: {e})") from None
    named, pipelined = _named_params(model)
    missing, bad_shape = [], []
    used: set[str] = set()
    pending = []
    for name, p in named:
        src_name = name
        if src_name not in state and src_name == "head.weight" and "embed.weight" in state:
            src_name = "embed.weight"  # a tied head saved only under the embedding's name
        if src_name not in state:
            missing.append(name)
            continue
        value = _slice_for_rank(state[src_name], p, tp, name)
        if tuple(value.shape) != tuple(p.shape):
            bad_shape.append(f"{name}: saved {tuple(value.shape)} (for this rank), model {tuple(p.shape)}")
            continue
        used.add(src_name)
        pending.append((p, value))
    problems = []
    if missing:
        problems.append(f"missing in {WEIGHTS}: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if bad_shape:
        problems.append("shape mismatch: " + "; ".join(bad_shape[:5]) + (" ..." if len(bad_shape) > 5 else ""))
    if not pipelined:
        tied = {"head.weight"} if "embed.weight" in used else set()
        unexpected = [k for k in state if k not in used and k not in tied]
        if unexpected:
            problems.append(f"in {WEIGHTS} but not in the model: {', '.join(unexpected[:8])}"
                            f"{' ...' if len(unexpected) > 8 else ''}")
    if problems:
        raise WarmStartError(f"train.init_from: {model_dir} does not fit this model ({'; '.join(problems)})")
    elements = 0
    with torch.no_grad():
        for p, value in pending:
            p.copy_(value.to(device=p.device, dtype=p.dtype))
            elements += p.numel()
    return {"model_dir": str(path), "parameters": len(pending), "elements": elements}
