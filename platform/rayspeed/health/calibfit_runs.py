"""`rayspeed plan --calibrate-from EXPERIMENT`: read an experiment's finished runs from MLflow, re-plan each from its
resolved config, and fit the profile's efficiency factors (rayspeed.planner.calibfit: the fit itself is pure)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any, Callable

from rayspeed.errors import ConfigError
from rayspeed.planner.calibfit import fit


def runs_from_mlflow(tracking_uri: str, experiment: str, replan: Callable[[Any], tuple[float, float, float]],
                     gpu: str | None = None, limit: int = 200) -> list[dict]:
    """Finished runs of `experiment` with a measured step time, each re-planned by `replan(JobConfig)`."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow

    from rayspeed.config.load import load
    from rayspeed.tracking.client import mlflow_client

    client = mlflow_client(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise ConfigError(f"--calibrate-from {experiment}: no such MLflow experiment at {tracking_uri}")
    out = []
    for run in client.search_runs([exp.experiment_id], max_results=limit):
        if run.info.status != "FINISHED":
            continue
        measured = run.data.metrics.get("plan/measured_step_time_s")
        if not measured:
            continue
        if gpu and run.data.params.get("plan.gpu") not in (None, gpu):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="config/resolved.yaml",
                                                           dst_path=tmp, tracking_uri=tracking_uri)
                cfg = load(path)
            except Exception:  # noqa: BLE001 - a run without its resolved config cannot be re-planned
                continue
        out.append({"run_id": run.info.run_id, "name": run.info.run_name, "measured": float(measured),
                    "groups": replan(cfg)})
    return out


def calibrate_from(cfg, experiment: str, base_profile: str | None, world_size: int | None = None) -> tuple[dict, str]:
    """Fit the factors on the experiment's runs; returns (fitted profile dict, where it was saved)."""
    from rayspeed.config.layout import LAYOUT_KEYS
    from rayspeed.paths import tracking_uri
    from rayspeed.planner import hwprofile
    from rayspeed.planner.plan import evaluate_layout

    base_path = base_profile or cfg.cluster.profile
    base = hwprofile.load(base_path, "--profile").data if base_path else {
        "kind": hwprofile.KIND, "version": hwprofile.VERSION, "device": "built-in table", "hardware": {}}
    base = dict(base, efficiency={"compute": 1.0, "comm": 1.0, "overhead": 1.0})
    base.pop("fit", None)

    def replan(job) -> tuple[float, float, float]:
        job = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, profile=None))
        lay = {k: getattr(job.parallel, k) for k in LAYOUT_KEYS}
        if not isinstance(lay["cp"], int):  # a run recorded before parallel.cp existed ran at cp 1
            lay["cp"] = 1
        if getattr(job.parallel, "stage_layers", None):
            lay["stage_layers"] = list(job.parallel.stage_layers)
        world = int(job.parallel.dp) * lay["cp"] * int(job.parallel.tp) * int(job.parallel.pp)
        d = evaluate_layout(job, lay, world_size=world, profile=base)
        t = d["time_breakdown_s"]
        return (t["compute_s"] + t["pp_bubble_s"] + t.get("straggler_s", 0.0),
                t["tp_comm_s"] + t["pp_p2p_s"] + t["dp_comm_s"],
                t["optimizer_s"] + t["zero3_overhead_s"])

    runs = runs_from_mlflow(tracking_uri(cfg), experiment, replan)
    fitted = fit(runs, base, experiment)
    dest = base_path or os.path.abspath(f"rayspeed-profile-{experiment}.json")
    hwprofile.save(fitted, dest)
    return fitted, dest
