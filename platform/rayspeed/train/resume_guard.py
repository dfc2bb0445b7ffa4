"""Resubmitting a job name resumes its newest verified checkpoint, but only when the parts that define the run
(model, data, optimizer and schedule) are the ones that checkpoint was trained with. Anything else is exit 2
naming what changed; `--resume-anyway` continues with the new settings (e.g. more steps), `--fresh` starts over.

Layout, cluster, resilience, tracking and health keys may change freely: they decide how the run is executed,
not what it computes.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rayspeed.checkpoint import manifest
from rayspeed.checkpoint.base_identity import base_identity
from rayspeed.config import adapter, hf_config
from rayspeed.config.load import flatten, to_dict
from rayspeed.config.schema import JobConfig
from rayspeed.errors import ConfigError

log = logging.getLogger("rayspeed")

# train.* keys that only decide how often something is measured, or how the model is compiled.
_TRAIN_EXEMPT = ("eval_every_steps", "eval_batches", "compile", "callbacks")
# data.* keys that only decide where or how the same data is fetched and cached.
_DATA_EXEMPT = ("cache_dir", "hf_cache_dir")
MODES = ("auto", "fresh", "anyway")


def run_identity(job: JobConfig) -> dict[str, Any]:
    """The keys that define what the run computes, flattened (`model.hidden_size`: 64, ...), as the user gave them."""
    d = to_dict(job)
    ident = {"model": d["model"],
             "data": {k: v for k, v in d["data"].items() if k not in _DATA_EXEMPT},
             "train": {k: v for k, v in d["train"].items() if k not in _TRAIN_EXEMPT}}
    out = {k: v for k, v in flatten(ident).items()}
    m = job.model
    if (adapter.enabled(m.adapter) and m.pretrained and m.init == "pretrained"
            and (not job.train.init_from or adapter.init_adapter_dir(job))):
        # The checkpoints hold the adapter only: its base is part of what the run computes.
        out["model.pretrained (weights)"] = base_identity(str(m.pretrained),
                                                          str(hf_config.resolve_file(str(m.pretrained)).parent))
    return out


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """'key: saved -> now' for every key that differs; a key the saved run's rayspeed did not have yet counts as
    its default (a newer rayspeed's new key, left at its default, changes nothing the old run computed)."""
    keys = sorted(set(saved) | set(now))
    defaults = flatten(to_dict(JobConfig())) if set(now) - set(saved) else {}
    saved = {**{k: defaults[k] for k in set(now) - set(saved) if k in defaults}, **saved}
    return [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]


def check(job: JobConfig, experiment_dir: str, mode: str) -> str | None:
    """Raise ConfigError when the newest verified checkpoint was trained for another run and mode is auto; returns
    the name of the checkpoint a --fresh start must set aside (None when there is nothing to resume)."""
    newest, _ = manifest.latest_verified(experiment_dir, deep=False)
    if newest is None:
        return None
    name = manifest.name_of(newest)
    if mode == "fresh":
        return name
    meta = manifest.read_manifest(newest) or {}
    saved = meta.get("run_identity")
    if saved is None:  # written before the guard existed: nothing to compare
        log.info("checkpoint %s records no run identity; resuming it", name)
        return name
    changed = differences(saved, run_identity(job))
    if not changed:
        return name
    if mode == "anyway":
        log.warning("--resume-anyway: resuming %s with changed settings: %s", name, "; ".join(changed))
        return name
    shown = "; ".join(changed[:8]) + (f"; and {len(changed) - 8} more" if len(changed) > 8 else "")
    raise ConfigError(
        f"name: job {job.name!r} has a checkpoint ({name}) trained with other settings ({shown}); resubmitting "
        "resumes only the same run: pass --resume-anyway to continue it with the new settings (e.g. more steps), "
        "--fresh to start over (the old checkpoints are set aside), or give the job another name")


def set_aside(exp: Any) -> str:
    """--fresh: the old run's files leave the job's folder (renamed on local storage, deleted on an object store,
    where a rename is a copy of everything) so nothing resumes from them. Returns what happened, for the log."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    if exp.is_local:
        target = exp.local.with_name(f"{exp.local.name}.superseded-{stamp}")
        exp.local.rename(target)
        exp.mkdirs()
        return f"moved the previous run's files to {target}"
    exp.delete()
    return f"deleted the previous run's files under {exp}"
