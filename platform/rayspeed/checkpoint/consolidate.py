"""A rayspeed checkpoint (`<storage>/<job>/checkpoint_stepN/`) -> the model's full fp32 weights, for exports.

    state, model_section, notes = consolidate(ckpt_dir)

Nothing is loaded before the manifest verifies (every file's size and sha256): DeepSpeed's files are pickles.
Where the weights come from, by the layout in the manifest:
  * ZeRO 1-3 without tensor or pipeline parallelism: DeepSpeed's own consolidation
    (`deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`), which assembles the fp32
    master weights from the data-parallel partitions (exact for bf16/fp16 training too);
  * expert parallelism (ZeRO 0-2): each ep rank's module states, the expert stacks concatenated in rank order;
  * otherwise (ZeRO 0, or tp/pp > 1 with ZeRO 0-1): the module states DeepSpeed writes per tensor-parallel
    rank (`mp_rank_XX_model_states.pt`) or per pipeline layer (`layer_XX-model_YY-model_states.pt`),
    concatenated along each parameter's tensor-parallel dimension. Those hold the training dtype's copy: a
    note says so when that was not fp32.
The model section comes from the manifest (`model`, written since checkpoints carry it) or from the caller.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from rayspeed import families
from rayspeed.checkpoint import manifest
from rayspeed.config import adapter
from rayspeed.engine import deepspeed_state
from rayspeed.families import TensorNames
from rayspeed.families.family import is_expert_stack


class ConsolidateError(ValueError):
    """The directory is not a checkpoint this can read; the message names it and the fix."""


def manifest_model_meta(cfg: Any) -> dict[str, Any]:
    """What a checkpoint's manifest carries so that it can be exported on its own: the model section, the
    tokenizer setting and the training precision."""
    import dataclasses

    from rayspeed.config.adapter import init_adapter_dir

    # The adapter's base: a warm start's model (init_from), or model.pretrained (also under a PEFT adapter's init).
    return {"model": dataclasses.asdict(cfg.model), "tokenizer": cfg.data.tokenizer,
            "precision": cfg.train.precision, "init_from": None if init_adapter_dir(cfg) else cfg.train.init_from}


def find_checkpoint(path: str) -> Path:
    """path itself when it is a checkpoint, else the newest verified checkpoint under it (a job's folder)."""
    p = Path(path).expanduser()
    if (p / manifest.MANIFEST).is_file() or manifest.step_of(p) is not None:
        return p
    found, skipped = manifest.latest_verified(p)
    if found is None:
        why = f" ({'; '.join(skipped[:3])})" if skipped else ""
        raise ConsolidateError(f"{path}: no verified rayspeed checkpoint in it{why}; give a checkpoint_stepN "
                               "folder with its manifest.json, or an MLflow run id")
    return Path(found)


def _load(path: Path) -> Any:
    import torch

    # Verified against the manifest's sha256 before this point: these are the files rayspeed wrote.
    return torch.load(path, map_location="cpu", weights_only=False)


def _merge_tp(parts: list[dict[str, Any]], names: TensorNames) -> dict[str, Any]:
    import torch

    out = {}
    for name in parts[0]:
        dim = adapter.partition_dim(name) if adapter.is_adapter(name) else names.partition_dim(name)
        tensors = [p[name].float() for p in parts]
        out[name] = torch.cat(tensors, dim=dim) if dim is not None and len(parts) > 1 else tensors[0]
    return out


def _module_states(ds: Path, tp: int, names: TensorNames) -> dict[str, Any]:
    parts = []
    for r in range(tp):
        f = ds / deepspeed_state.model_states_file(r)
        if not f.is_file():
            raise ConsolidateError(f"{ds}: {f.name} is missing")
        parts.append(dict(_load(f)["module"]))
    return _merge_tp(parts, names)


def _expert_states(ds: Path, ep: int) -> dict[str, Any]:
    """The module states of each ep rank (DeepSpeed's model-parallel files under expert parallelism, tp 1): the
    expert stacks (layers.i.mlp.w_gate, w_up, w_down and a family's own) concatenated in rank order, the rest from
    rank 0."""
    import torch

    parts = []
    for r in range(ep):
        f = ds / deepspeed_state.model_states_file(r)
        if not f.is_file():
            raise ConsolidateError(f"{ds}: {f.name} is missing")
        parts.append(dict(_load(f)["module"]))
    return {name: torch.cat([p[name].float() for p in parts]) if is_expert_stack(name) else value.float()
            for name, value in parts[0].items()}


def _layer_prefix(idx: int, num_layers: int) -> Optional[str]:
    """Canonical prefix of pipeline layer spec idx: [embed] [block 0..L-1] [final norm] [head or tied embed]."""
    if idx == 0:
        return "embed."
    if idx <= num_layers:
        return f"layers.{idx - 1}."
    if idx == num_layers + 1:
        return "norm."
    return "head."


def _pipeline_states(ds: Path, tp: int, model: dict[str, Any], names: TensorNames) -> dict[str, Any]:
    by_rank: list[dict[str, Any]] = [{} for _ in range(tp)]
    files = deepspeed_state.layer_files(ds)
    if not files:
        raise ConsolidateError(f"{ds}: no layer_XX-*-model_states.pt files (not a pipeline checkpoint)")
    for f, idx, rank in files:
        prefix = _layer_prefix(idx, int(model["num_layers"]))
        if prefix == "head." and model.get("tie_embeddings"):
            continue  # the tied head is the embedding, already read from layer 0
        for k, v in _load(f).items():
            by_rank[rank][prefix + k] = v
    return _merge_tp(by_rank, names)


def consolidate(ckpt_dir: str, model_section: Optional[dict[str, Any]] = None
                ) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(full fp32 state dict under the Transformer's names, the model section, notes). Raises ConsolidateError."""
    path = find_checkpoint(ckpt_dir)
    verdict = manifest.verify(path, deep=True)
    if not verdict.ok:
        raise ConsolidateError(f"{path}: not a verified rayspeed checkpoint ({verdict.reason}); nothing was loaded")
    meta = manifest.read_manifest(path) or {}
    model = meta.get("model") or model_section
    if not model:
        raise ConsolidateError(f"{path}/{manifest.MANIFEST} has no model section (written before checkpoints "
                               "carried one): pass the job file with --config, or export from the MLflow run id")
    layout = meta.get("layout") or {}
    tp, pp, zero = int(layout.get("tp", 1)), int(layout.get("pp", 1)), int(layout.get("zero_stage", 0))
    ds = path / deepspeed_state.TAG
    notes = [f"{path.name}: step {meta.get('step')}, layout dp={layout.get('dp')} tp={tp} pp={pp} ZeRO-{zero}"]
    ep = int(layout.get("ep", 1))
    if ep > 1:
        if zero == 3:
            raise ConsolidateError(f"{path}: ZeRO-3 with ep={ep} cannot be consolidated here; export from the MLflow "
                                   "run id (the job logs its full model at the end)")
        state = _expert_states(ds, ep)
        if meta.get("precision", "fp32") not in ("fp32", None):
            notes.append(f"weights from the module states, i.e. the {meta.get('precision')} training copy")
    elif zero >= 1 and tp == 1 and pp == 1:
        state = deepspeed_state.fp32_from_zero(path)
        notes.append("fp32 master weights consolidated by deepspeed.utils.zero_to_fp32")
    elif zero == 3:
        raise ConsolidateError(f"{path}: ZeRO-3 with tp={tp} pp={pp} cannot be consolidated here; export from the "
                               "MLflow run id (the job logs its full model at the end)")
    else:
        # The family's name map says how each tensor was split; one rayspeed does not know splits as the default's.
        names = (families.find(model.get("architecture")) or families.DEFAULT).tensor_names
        state = _pipeline_states(ds, tp, model, names) if pp > 1 else _module_states(ds, tp, names)
        precision = meta.get("precision", "fp32")
        if precision not in ("fp32", None):
            notes.append(f"weights from the module states, i.e. the {precision} training copy")
    state = {k: v.float().contiguous() for k, v in state.items()}
    if model.get("tie_embeddings"):
        state.pop("head.weight", None)
    return state, model, notes
