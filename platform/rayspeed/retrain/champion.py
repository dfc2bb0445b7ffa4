"""The champion and the evidence a promotion rests on: the version under the alias, the val/loss recorded on a
version, the loss of an exported model on the job's held-out split, and what an adapter job warm-starts from."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

from rayspeed import paths
from rayspeed.tracking.client import mlflow_client

log = logging.getLogger("rayspeed.retrain.cycle")

CHAMPION = "champion"


def champion_version(uri: str, name: str, alias: str = CHAMPION) -> Optional[Any]:
    """The ModelVersion the alias points at; None when the model or the alias does not exist. Raises when the
    store cannot be read (a cycle must not train from scratch because the server is down)."""
    from mlflow.exceptions import MlflowException

    c = mlflow_client(uri)
    try:
        model = c.get_registered_model(name)
    except MlflowException as e:
        if getattr(e, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND"):
            return None
        raise
    aliases = getattr(model, "aliases", None) or {}
    version = aliases.get(alias)
    if version is None:
        return None
    return c.get_model_version(name, str(version))


def metric_of(tags: dict[str, str], key: str = "val/loss") -> Optional[float]:
    try:
        return float(tags[f"metric.{key}"])
    except (KeyError, TypeError, ValueError):
        return None


def version_of_run(uri: str, name: str, run_id: str) -> Optional[str]:
    found = [mv for mv in mlflow_client(uri).search_model_versions(f"run_id = '{run_id}'") if mv.name == name]
    if not found:
        return None
    return str(max(int(mv.version) for mv in found))


def token_file(cfg: Any, storage: str) -> Any:
    """The job's corpus (rayspeed.train.data_setup.Corpus: content_hash, and the source's own validation split),
    tokenized into the same cache the workers use (a local process pool) when it is not there yet."""
    from rayspeed.train.data_setup import load_corpus

    return load_corpus(cfg, storage, executor="pool")


def evaluate_model_dir(model_dir: str, cfg: Any, token_file: Any) -> float:
    """Mean validation loss of an exported model on the job's held-out split: the same sequences the job's
    workers evaluate (eval_batches global batches of the val split), fp32 on the CPU; with ignored labels (chat,
    document masking) the mean over the counted labels, as the job computes it."""
    import torch

    from rayspeed.data import val_batches
    from rayspeed.data.token_split import IGNORE_INDEX
    from rayspeed.model.export import load_model
    from rayspeed.train.data_setup import splits

    model = load_model(model_dir)
    _, val = splits(token_file, cfg)
    batches = val_batches(val, cfg.model.seq_len, cfg.train.global_batch_size, cfg.train.eval_batches, 0, 1,
                          cfg.data.document_masking)
    weighted = val.mask is not None or cfg.data.document_masking
    total, n = 0.0, 0
    with torch.no_grad():
        for mb in batches:
            k = int((mb[1] != IGNORE_INDEX).sum()) if weighted else 1
            total += float(model(*mb).double()) * k
            n += k
    return total / max(1, n)


def reevaluate(uri: str, name: str, versions: list[str], cfg: Any, token_file: Any, storage: str,
               max_gflop: float) -> tuple[Optional[list[float]], str]:
    """Every version's val/loss measured the same way: on the job's current held-out split, fp32 on the CPU
    (evaluate_model_dir), so a champion and a challenger are compared like with like whatever precision and data
    each was trained and validated with. (None, why) when that would cost more than max_gflop or fails."""
    from rayspeed.model.warm_start import read_model_config
    from rayspeed.tracking.model_fetch import resolve_init_from

    cache = str(Path(storage) / ".cache" / "models") if not paths.is_uri(storage) else None
    try:
        dirs = [resolve_init_from(f"models:/{name}/{v}", uri, cache) for v in versions]  # cached after warm start
        gflop = sum(eval_gflop(read_model_config(d), cfg) for d in dirs)
        if gflop > max_gflop:
            return None, (f"re-evaluating them on this data would take ~{gflop:.0f} GFLOP on the CPU "
                          f"> {max_gflop:g}")
        return [evaluate_model_dir(d, cfg, token_file) for d in dirs], "fp32 on the CPU, current held-out split"
    except Exception as e:
        return None, f"re-evaluation failed: {str(e)[:200]}"


def eval_gflop(model_cfg: dict[str, Any], cfg: Any) -> float:
    from types import SimpleNamespace

    from rayspeed.model.transformer import count_parameters

    params = count_parameters(SimpleNamespace(**model_cfg))
    tokens = cfg.train.eval_batches * cfg.train.global_batch_size * cfg.model.seq_len
    return 2.0 * params * tokens / 1e9


def adapter_warm_start(cfg: Any, model_dir: str, shared_cache: bool) -> Optional[str]:
    """An adapter job's warm start: the champion's own adapter (its PEFT files beside the merged model), continued on
    model.pretrained, so every version stays an adapter of the one base its PEFT files name (a new adapter stacked on
    the champion's merged weights would name a base nobody serves). None, and the merged warm start, when the job
    has no adapter, when its adapter settings changed since the champion's (a new adapter then; the modules it
    trains in full too), when the champion's adapter names another base than model.pretrained, or when the download
    is not on the job's storage (a URI storage path: the workers could not read it)."""
    from rayspeed.config.adapter import PEFT_CONFIG, enabled, init_adapter_problems
    from rayspeed.config.shape import ModelShape
    from rayspeed.model.export import ADAPTER_DIR

    folder = Path(model_dir) / ADAPTER_DIR
    if not enabled(cfg.model.adapter) or not (folder / PEFT_CONFIG).is_file():
        return None
    why = None
    if not shared_cache:
        why = "the champion's download is not on the job's storage (a URI storage path)"
    elif not cfg.model.pretrained:
        why = "model.pretrained is not set"
    elif not _same_base(json.loads((folder / PEFT_CONFIG).read_text()).get("base_model_name_or_path"),
                        str(cfg.model.pretrained)):
        # (a version that was itself warm-started from a merged champion names that one, not model.pretrained)
        why = "the champion's adapter was trained on another base than model.pretrained"
    else:
        probe = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=str(folder)))
        problems = init_adapter_problems(probe, ModelShape.from_config(cfg.model))
        why = problems[0] if problems else None
    if why:
        log.info("warm start from the champion's merged model with a new adapter, not its adapter: %s", why)
        return None
    log.info("warm start: the champion's adapter (%s) continues on model.pretrained %s", folder, cfg.model.pretrained)
    return str(folder)


def _same_base(theirs: Any, mine: str) -> bool:
    """Whether an adapter's base_model_name_or_path names model.pretrained (a folder by its resolved path)."""
    if not theirs:
        return False
    if os.path.isdir(str(theirs)) and os.path.isdir(mine):
        return os.path.realpath(str(theirs)) == os.path.realpath(mine)
    return str(theirs) == mine
