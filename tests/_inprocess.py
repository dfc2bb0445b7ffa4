"""A job's worker path without Ray: the launcher's steps (plan, data, the MLflow run) in this process, then the
worker (`run_worker`: re-plan, Trainer, checkpoints, MLflow logging, export) in N local processes joined by gloo.
For parity over layouts, where what differs is the layout and Ray's part is the same for each (one Ray job per
feature proves that part through `python jobs/train.py`).

    result = run_inprocess(home, config, ["parallel.tp=2", ...], workers=2)   # rank 0's RunResult (JSON)
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from unittest import mock

from _cluster import seed_store
from _dist import run_distributed


def _rank(rank: int, world: int, payload: dict) -> dict:
    from rayspeed.train.context import WorkerContext
    from rayspeed.train.payload import LaunchPayload
    from rayspeed.train.worker import run_worker

    p = LaunchPayload(**payload)
    ctx = WorkerContext(rank, world, rank, 0, "inprocess", p.experiment_dir, under_ray=False)
    return run_worker(p, ctx).to_json()


def run_inprocess(home: Path, config: str, sets: list[str], workers: int, timeout_s: float = 120.0) -> dict:
    """Rank 0's RunResult (as JSON) of the job `config` with `--set` items `sets` on `workers` processes."""
    import dataclasses

    from rayspeed.config.load import load, to_dict
    from rayspeed.paths import storage_path, tracking_uri
    from rayspeed.planner import resolve
    from rayspeed.storage import locate
    from rayspeed.tracking.runs import find_or_create_run
    from rayspeed.train.data_setup import prepare
    from rayspeed.train.payload import LaunchPayload
    from rayspeed.train.resume_guard import run_identity

    seed_store(home)
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    with mock.patch.dict(os.environ, {**env, "RAYSPEED_HOME": str(home)}, clear=True):
        job = load(config, sets)
        cfg, _ = resolve(job, world_size=workers)
        storage = storage_path(cfg)
        exp = locate(storage).child(cfg.name)
        exp.mkdirs()
        prepare(cfg, storage, "local")
        run_id, _ = find_or_create_run(cfg)
        payload = LaunchPayload(job=to_dict(job), tracking_uri=tracking_uri(cfg), storage_path=storage,
                                experiment_dir=str(exp), launched_at=time.time(), mlflow_run_id=run_id,
                                run_identity=run_identity(job))
        results = run_distributed(_rank, workers, dataclasses.asdict(payload), timeout_s=timeout_s,
                                  env={"RAYSPEED_HOME": str(home)})
    return results[0]
