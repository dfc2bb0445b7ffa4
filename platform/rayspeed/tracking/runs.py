"""Which MLflow run a job writes to: one run per job name, across restarts, resizes and resubmissions.
mlflow is imported lazily so planning and config checks never pay for it."""

from __future__ import annotations

import logging
from typing import Any, Optional

from rayspeed.config.schema import AUTO, JobConfig
from rayspeed.paths import artifact_root, tracking_uri
from rayspeed.tracking.client import mlflow_client, set_terminated
from rayspeed.tracking.hf_model import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, plan_line, run_tags

log = logging.getLogger(__name__)

JOB_TAG = "rayspeed.job"


def registered_model_name(cfg: JobConfig) -> str:
    return cfg.tracking.register_model if cfg.tracking.register_model != AUTO else f"rayspeed-{cfg.name}"


def experiment_id(client: Any, name: str, uri: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        if EXPERIMENT_KIND_TAG not in (exp.tags or {}):
            # Made by someone else (mlflow's fluent API, an older rayspeed): without the kind, MLflow 3's UI opens
            # it as a GenAI experiment (traces, prompts) instead of its runs. A kind someone chose stays.
            client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return exp.experiment_id
    location = artifact_root(uri) if uri.startswith("sqlite:") or uri.startswith("file:") or "://" not in uri else None
    try:
        return client.create_experiment(name, artifact_location=location,
                                        tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    except Exception:  # created concurrently by another job
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def find_or_create_run(cfg: JobConfig, extra_tags: dict[str, str] | None = None,
                       uri: Optional[str] = None) -> tuple[str, bool]:
    """(run id, resumed): the job's existing run if one exists (same experiment, tag rayspeed.job = name),
    else a new one. Resubmitting a job name therefore continues its run. `uri`: the store the launcher resolved
    (a worker's own environment may not name it)."""
    uri = uri or tracking_uri(cfg)
    client = mlflow_client(uri)
    exp_id = experiment_id(client, cfg.tracking.experiment, uri)
    runs = client.search_runs(
        [exp_id],
        filter_string=f"tags.`{JOB_TAG}` = '{cfg.name}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    source = run_tags(plan_line(cfg))  # this attempt's plan and commit, also on a continued run
    if runs:
        run_id = runs[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        for k, v in source.items():
            client.set_tag(run_id, k, v)
        return run_id, True
    tags = {JOB_TAG: cfg.name, "mlflow.runName": cfg.name, **source}
    tags.update(extra_tags or {})
    run = client.create_run(exp_id, run_name=cfg.name, tags=tags)
    return run.info.run_id, False


def supersede_run(cfg: JobConfig, uri: Optional[str] = None) -> Optional[str]:
    """--fresh: the job's current run stops being the job's run (its rayspeed.job tag gets a suffix), so the next
    find_or_create_run starts a new one; returns the old run id (None when there was none or tracking is away)."""
    import time

    try:
        uri = uri or tracking_uri(cfg)
        client = mlflow_client(uri)
        exp_id = experiment_id(client, cfg.tracking.experiment, uri)
        runs = client.search_runs([exp_id], filter_string=f"tags.`{JOB_TAG}` = '{cfg.name}'")
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        for r in runs:
            client.set_tag(r.info.run_id, JOB_TAG, f"{cfg.name}@superseded-{stamp}")
            if r.info.status == "RUNNING":
                set_terminated(client, r.info.run_id, "KILLED")
        return runs[0].info.run_id if runs else None
    except Exception as e:  # tracking must never stop training
        log.warning("could not set the previous MLflow run of %s aside: %s", cfg.name, e)
        return None


def finish_run(cfg: JobConfig, run_id: str, status: str, label: str | None = None) -> None:
    """Close the run: MLflow status FINISHED/FAILED, tag rayspeed.status = label (e.g. preflight_failed)."""
    try:
        client = mlflow_client(tracking_uri(cfg))
        client.set_tag(run_id, "rayspeed.status", label or status.lower())
        set_terminated(client, run_id, status)
    except Exception as e:  # tracking must never fail the job
        log.warning("could not close MLflow run %s: %s", run_id, e)
