"""The champion and the evidence a promotion rests on: the version under the alias, the val/loss recorded on a
version, and the loss of an exported model on the job's held-out split."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from rayspeed import paths
from rayspeed.tracking.client import mlflow_client

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
    from rayspeed.config.schema import AUTO
    from rayspeed.data import build_token_file

    c = cfg.data
    # The same cache the workers use.
    cache = c.cache_dir if c.cache_dir != AUTO else paths.data_cache_dir(storage, cfg.storage.staging_dir, cfg.name)
    return build_token_file(c.source, c.path, c.tokenizer, cache)


def evaluate_model_dir(model_dir: str, cfg: Any, token_file: Any) -> float:
    """Mean validation loss of an exported model on the job's held-out split: the same sequences the job's
    workers evaluate (eval_batches global batches of the val split), fp32 on the CPU."""
    import torch

    from rayspeed.data import val_batches
    from rayspeed.model.export import load_model

    model = load_model(model_dir)
    _, val = token_file.split(cfg.data.val_fraction, cfg.model.seq_len)
    batches = val_batches(val, cfg.model.seq_len, cfg.train.global_batch_size, cfg.train.eval_batches, 0, 1)
    total, n = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            total += float(model(x, y).double())
            n += 1
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
