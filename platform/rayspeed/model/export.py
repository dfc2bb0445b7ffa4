"""The final model in a form anyone can reload without DeepSpeed, Ray or the training layout.

    path = export_model(engine, cfg, out_dir, groups=groups)   # collective: every rank calls it
    model = load_model(path)                                    # a rayspeed Transformer, fp32, on the CPU

Directory layout (logged as the run's `model/` artifact and registered, see tracking.registry):
    weights.pt          state_dict of rayspeed.model.transformer.Transformer (fp32, CPU tensors, full
                        unsharded shapes; torch.load(weights_only=True)-safe)
    model_config.json   the model section of the resolved job config (+ the seed)
    export.json         how it was made: layout, dtype, complete, limitation notes, versions
    README.md           how to load it
    adapter/            a job with model.adapter: its adapter in PEFT's files (adapter_config.json,
                        adapter_model.safetensors); weights.pt then holds the merged model

Where the weights come from:
  * fp32 master weights when DeepSpeed keeps them apart from the module (bf16/fp16 training, ZeRO 1-3):
    deepspeed.utils.safe_get_full_fp32_param, which assembles the data-parallel partitions (ZeRO-3
    included); otherwise the module's own parameters (fp32 training).
  * tp > 1: each parameter is all-gathered over the tensor-parallel group to its full shape
    (rayspeed.parallel.layers.gather_full); ep > 1: each expert stack over the expert-parallel group, in rank order.
  * pp > 1: every stage names its parameters as the Transformer does (canonical_named_parameters) and
    sends them to global rank 0 (gather_object over the pipeline group of dp rank 0, tp rank 0).
The whole model is assembled in rank 0's host memory, one parameter at a time on the accelerator side,
so this is for models whose fp32 weights fit in one host's RAM; above `max_host_gib` (default 64) it
writes only the config plus a note that the DeepSpeed checkpoint (zero_to_fp32.py) is the way.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

WEIGHTS = "weights.pt"
CONFIG = "model_config.json"
META = "export.json"
ADAPTER_DIR = "adapter"

_README = """# {name}: exported rayspeed model

Reload (needs only torch and the rayspeed package):

```python
from rayspeed.model.export import load_model
model = load_model("{path_hint}")          # rayspeed.model.transformer.Transformer, fp32, eval mode
loss = model(input_ids, labels)            # mean cross-entropy; model(input_ids) gives logits
```

Or by hand: `Transformer(SimpleNamespace(**json.load(open("model_config.json"))["model"]))` then
`load_state_dict(torch.load("weights.pt", weights_only=True))`.

- source layout: dp={dp} tp={tp} pp={pp} ZeRO-{zero}, training precision {precision}
- weights: {weights_from}
- complete: {complete}
{limitations}
"""


def _engine_and_module(obj: Any) -> tuple[Any, Any]:
    if hasattr(obj, "module") and hasattr(obj, "zero_optimization_stage"):
        return obj, obj.module
    return None, obj


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _full_fp32(p: Any, tp: Any) -> Any:
    """The parameter's full fp32 value on the CPU (collective over dp for DeepSpeed-held masters, over tp
    for sharded parameters). Same call sequence on every rank of the stage."""
    import torch

    value = None
    if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):  # only DeepSpeed sets these: it is imported
        from deepspeed.utils import safe_get_full_fp32_param

        value = safe_get_full_fp32_param(p)
        if value is None and hasattr(p, "ds_id"):  # ZeRO-3 keeps no fp32 master of a frozen (adapter job's) base
            import deepspeed

            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                value = p.detach().clone()
    if value is None:
        value = p.detach()
    value = value.float()
    if tp is not None and getattr(tp, "world_size", 1) > 1:
        from rayspeed.parallel.layers import gather_full

        value = gather_full(value, p, tp)
    if getattr(p, "expert_parallel", False):  # this rank's experts: the whole stack from every ep rank's
        from rayspeed.parallel.expert_parallel import gather_experts

        value = gather_experts(value, p.expert_group)
    return value.detach().to("cpu", copy=True).to(torch.float32).contiguous()


def _named_params(module: Any) -> tuple[list[tuple[str, Any]], bool]:
    """(canonical name, parameter) pairs of this rank's part of the model, and whether it is a pipeline stage."""
    if is_pipeline(module):
        from rayspeed.model.decoder import canonical_named_parameters

        seen, out = set(), []
        for name, p in canonical_named_parameters(module):
            if name not in seen:
                seen.add(name)
                out.append((name, p))
        return out, True
    return list(module.named_parameters()), False


def is_pipeline(module: Any) -> bool:
    if "deepspeed" not in sys.modules:  # a PipelineModule cannot exist without it; don't pay the import
        return False
    from deepspeed.pipe import PipelineModule

    return isinstance(module, PipelineModule)


def _layout(cfg: Any, groups: Any) -> dict[str, Any]:  # ints, or what an unresolved config holds (auto)
    par = getattr(cfg, "parallel", None)
    get = (lambda k, d=1: getattr(par, k, d) if par is not None else d)
    lay = {"dp": get("dp"), "tp": get("tp"), "pp": get("pp"), "zero_stage": get("zero_stage", 0)}
    if groups is not None:
        lay.update(dp=groups.dp, tp=groups.tp_size, pp=groups.pp)
        if groups.cp_size > 1:
            lay["cp"] = groups.cp_size
    return {k: (int(v) if isinstance(v, int) else v) for k, v in lay.items()}


def _model_section(cfg: Any) -> dict[str, Any]:
    import dataclasses

    from rayspeed.config.shape import ModelShape

    m = cfg.model
    d = dataclasses.asdict(m) if dataclasses.is_dataclass(m) and not isinstance(m, type) else dict(vars(m))
    # Concrete sizes, so the reload never depends on schema defaults.
    shape = ModelShape.from_config(m)
    d.update(num_kv_heads=shape.num_kv_heads, ffn_hidden_size=shape.ffn_hidden_size)
    return d


def export_model(engine_or_module: Any, cfg: Any, out_dir: str, groups: Any = None,
                 max_host_gib: float = 64.0, base: Optional[Callable[[], dict[str, Any]]] = None) -> str:
    """Write the reloadable model into out_dir (created); returns out_dir on every rank.

    Collective: every rank calls it (dp/tp/pp gathers). Only global rank 0 writes files. groups: the
    worker's ParallelGroups (needed for tp>1 / pp>1; the non-pipelined engine's mpu is used if omitted).
    The returned directory's export.json says whether the weights are complete; the limitation, if any,
    is also in README.md.
    """
    import torch

    t0 = time.perf_counter()
    engine, module = _engine_and_module(engine_or_module)
    if groups is None and engine is not None:
        groups = getattr(engine, "mpu", None)
    tp = getattr(groups, "tp", None) if groups is not None else getattr(module, "tp", None)
    rank = _rank()
    out = Path(out_dir)
    layout = _layout(cfg, groups)
    precision = getattr(getattr(cfg, "train", None), "precision", "fp32")
    limitations: list[str] = []

    named, pipelined = _named_params(module)
    # From the config, so every rank takes the same branch (a split decision would hang the gathers).
    from rayspeed.model.transformer import count_parameters

    total_bytes = 4 * count_parameters(SimpleNamespace(**_model_section(cfg)))
    too_big = total_bytes / 2**30 > max_host_gib

    state: Optional[dict[str, Any]]  # None: rank 0 could not gather a pipeline's stages
    state = {}
    complete = True
    if too_big:
        complete = False
        limitations.append(
            f"weights not exported: about {total_bytes / 2**30:.0f} GiB in fp32 exceeds max_host_gib={max_host_gib}; "
            "consolidate the final DeepSpeed checkpoint with its zero_to_fp32.py instead"
        )
    else:
        with torch.no_grad():
            for name, p in named:
                value = _full_fp32(p, tp)  # collective: every rank, same order
                if rank == 0 or pipelined:
                    state[name] = value
        if pipelined:
            state = _gather_pipeline(state, groups)
            if rank == 0 and state is None:
                complete = False
                limitations.append("pipeline stages could not be gathered to rank 0 (no ParallelGroups given)")
    if rank != 0:
        _barrier()
        return str(out)
    try:
        _write(out, cfg, state, layout, precision, complete, limitations, t0, base)
    except Exception as e:  # a full disk must not take the job down at its last step
        log.warning("model export to %s failed while writing (%s)", out, e)
    finally:
        _barrier()
    return str(out)


def _write(out: Path, cfg: Any, state: Optional[dict[str, Any]], layout: dict[str, Any], precision: str, complete: bool,
           limitations: list[str], t0: float, base: Optional[Callable[[], dict[str, Any]]] = None) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    model_cfg = _model_section(cfg)
    seed = int(getattr(getattr(cfg, "train", None), "seed", 0) or 0)
    weights_from = "module parameters (fp32 training)"
    if precision in ("bf16", "fp16") or layout.get("zero_stage") == 3:
        weights_from = "DeepSpeed fp32 master weights (safe_get_full_fp32_param)"
    adapter = _fold_adapter(cfg, state, out, model_cfg, base)
    if state:
        # The Transformer's state_dict also lists a tied head under its own name.
        if model_cfg.get("tie_embeddings") and "embed.weight" in state and "head.weight" not in state:
            state["head.weight"] = state["embed.weight"]
        missing = _missing_keys(model_cfg, state)
        if missing:
            complete = False
            limitations.append(f"missing parameters: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
        torch.save(state, out / WEIGHTS)
    with open(out / CONFIG, "w") as fh:
        json.dump({"model": model_cfg, "seed": seed, "class": "rayspeed.model.transformer.Transformer"}, fh, indent=2)
    if state is None:  # a pipeline without groups: no weights, no export.json; export_model logs this message
        raise ValueError("pipeline stages could not be gathered to rank 0 (no ParallelGroups given)")
    meta: dict[str, Any] = {
        "format": "rayspeed-model/1",
        "complete": complete and bool(state),
        "layout": layout,
        "precision_trained": precision,
        "weights_dtype": "float32",
        "weights_from": weights_from,
        "num_parameters": int(sum(v.numel() for k, v in state.items()
                                  if not (k == "head.weight" and model_cfg.get("tie_embeddings")))),
        "limitations": limitations,
        "adapter": adapter,
        "job": getattr(cfg, "name", None),
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": round(time.perf_counter() - t0, 3),
        "versions": {"torch": torch.__version__},
    }
    if "deepspeed" in sys.modules:
        meta["versions"]["deepspeed"] = getattr(sys.modules["deepspeed"], "__version__", "?")
    with open(out / META, "w") as fh:
        json.dump(meta, fh, indent=2)
    with open(out / "README.md", "w") as fh:
        fh.write(_README.format(
            name=meta["job"], path_hint="<this directory>", dp=layout["dp"], tp=layout["tp"], pp=layout["pp"],
            zero=layout["zero_stage"], precision=precision, weights_from=weights_from, complete=meta["complete"],
            limitations="".join(f"- limitation: {x}\n" for x in limitations),
        ))
    log.info("model exported to %s (%s, %.1f s)", out, "complete" if meta["complete"] else "INCOMPLETE",
             meta["seconds"])


def _fold_adapter(cfg: Any, state: Optional[dict[str, Any]], out: Path, model_cfg: dict[str, Any],
                  base_weights: Optional[Callable[[], dict[str, Any]]] = None) -> Optional[dict[str, Any]]:
    """A job with adapters exports the merged model (self-contained: it loads without its base) and the adapter in
    PEFT's files beside it (ADAPTER_DIR); `state` and `model_cfg` become the merged model's. Returns what
    export.json records of it (None: no adapter). A QLoRA job's module holds its linear weights in 4 bits: the
    adapter merges into the original weights, `base_weights()` (the trainer's engine.build.base_state)."""
    from rayspeed.config import adapter as spec

    a = getattr(cfg.model, "adapter", None)
    if not spec.enabled(a) or not state:
        return None
    from rayspeed.adapters.merge import adapted_layers, merged
    from rayspeed.adapters.peft_files import write_peft_dir
    from rayspeed.config.shape import ModelShape

    # The weights the adapter was trained on: a warm start's (train.init_from) when the job had one.
    base = spec.base_source(cfg)
    write_peft_dir(state, a, ModelShape.from_config(cfg.model), str(out / ADAPTER_DIR), base)
    record = {"section": dict(model_cfg["adapter"]), "merged_layers": len(adapted_layers(state)),
              "peft_dir": ADAPTER_DIR, "base": base}
    assert a is not None  # spec.enabled(None) is False
    if a.base_precision == "nf4":
        if base_weights is None:
            raise ValueError("a QLoRA export needs the job's original base weights to merge into")
        state.update({k: v for k, v in base_weights().items() if k not in state})
        record["merged_into"] = "the original base weights (the adapter trained against their NF4 quantization)"
    whole = merged(state, a, ModelShape.from_config(cfg.model).family)
    state.clear()
    state.update(whole)
    model_cfg["adapter"] = {**model_cfg["adapter"], "type": "none"}  # the weights hold it now
    return record


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _gather_pipeline(state: dict[str, Any], groups: Any) -> Optional[dict[str, Any]]:
    """Stage parameter dicts -> one dict on global rank 0 (gathered over rank 0's pipeline group)."""
    import torch.distributed as dist

    if groups is None:
        return None if _rank() == 0 else {}
    if groups.dp_rank != 0 or groups.tp_rank != 0:
        return {}
    parts: Optional[list] = [None] * groups.pp if groups.global_rank == 0 else None
    dist.gather_object(state, parts, dst=groups.pp_ranks[0], group=groups.pp_group)
    if groups.global_rank != 0:
        return {}
    merged: dict[str, Any] = {}
    for part in parts or []:
        merged.update(part or {})
    return merged


def _missing_keys(model_cfg: dict[str, Any], state: dict[str, Any]) -> list[str]:
    try:
        import torch

        with torch.device("meta"):
            ref = _build(model_cfg, 0)
        return [k for k in ref.state_dict() if k not in state]
    except Exception:
        return []


def _build(model_cfg: dict[str, Any], seed: int) -> Any:
    from types import SimpleNamespace

    from rayspeed.model.transformer import Transformer

    return Transformer(SimpleNamespace(**model_cfg), seed=seed)


def load_model(path: str, device: Any = "cpu", dtype: Any = None, strict: bool = True) -> Any:
    """Rebuild the Transformer from an exported directory (a local path; for a registered version,
    mlflow.artifacts.download_artifacts(f"models:/{name}/{version}") first). Eval mode, fp32 unless dtype."""
    import torch

    p = Path(path)
    with open(p / CONFIG) as fh:
        spec = json.load(fh)
    if not (p / WEIGHTS).exists():
        meta = json.loads((p / META).read_text()) if (p / META).exists() else {}
        why = "; ".join(meta.get("limitations", [])) or "incomplete export"
        raise FileNotFoundError(f"{p / WEIGHTS} missing: {why}")
    state = torch.load(p / WEIGHTS, map_location="cpu", weights_only=True)
    model = _build(spec["model"], int(spec.get("seed", 0)))
    model.load_state_dict(state, strict=strict)
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    model.eval()
    return model
