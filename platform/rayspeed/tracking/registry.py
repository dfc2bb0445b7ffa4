"""Model registry: the exported model logged as the run's `model/` artifact and registered as a version of
`tracking.register_model`, tagged with the run's metrics; aliases (`champion`) for the retraining cycle.

    version = log_and_register(uri, run_id, model_dir, registered_model_name(cfg), {"val/loss": 1.23})
    set_alias(uri, name, version)                      # alias "champion" -> this version
    get_alias_version(uri, name)                       # "3" or None

Tracking must never fail the job: every function logs and survives failures (returns None / False), retries
a few times with backoff, and gives up after `timeout_s` even if the server hangs (the work runs on a
daemon thread the caller does not wait for beyond that).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from typing import Any, Callable, Optional

from rayspeed.tracking.client import mlflow_client

log = logging.getLogger(__name__)

CHAMPION = "champion"
MODEL_ARTIFACT = "model"


def bounded(fn: Callable[[], Any], what: str, timeout_s: float, attempts: int = 3) -> tuple[bool, Any]:
    """fn() with retries, on a daemon thread, for at most timeout_s. (ok, result)."""
    box: dict[str, Any] = {}

    def run() -> None:
        delay = 1.0
        for i in range(attempts):
            try:
                box["result"] = fn()
                box["ok"] = True
                return
            except Exception as e:  # server away, store locked, bad input
                box["error"] = e
                if i + 1 < attempts:
                    time.sleep(delay)
                    delay *= 2

    t = threading.Thread(target=run, name=f"rayspeed-registry-{what}", daemon=True)
    t.start()
    t.join(timeout_s)
    if box.get("ok"):
        return True, box.get("result")
    reason = "timed out" if t.is_alive() else str(box.get("error", "unknown error")).splitlines()[0][:300]
    log.warning("MLflow registry: %s failed (%s); training result is unaffected", what, reason)
    return False, None


def metric_tags(metrics: dict[str, Any]) -> dict[str, str]:
    tags = {}
    for k, v in (metrics or {}).items():
        try:
            f = float(v)
            tags[f"metric.{k}"] = repr(f) if math.isfinite(f) else str(f)
        except (TypeError, ValueError):
            tags[f"metric.{k}"] = str(v)[:5000]
    return tags


def log_and_register(tracking_uri: str, run_id: str, model_dir: str, registered_name: str,
                     metrics: Optional[dict[str, Any]] = None, timeout_s: float = 300.0,
                     extra_tags: Optional[dict[str, str]] = None) -> Optional[str]:
    """Log model_dir as the run's `model/` artifact and register it as a new version of registered_name
    (created if missing) with source = the run's artifact URI of model/, run_id, and the metrics as
    version tags `metric.<name>`. Returns the version number (str), or None if anything failed (logged)."""
    def upload() -> None:
        mlflow_client(tracking_uri).log_artifacts(run_id, model_dir, MODEL_ARTIFACT)

    ok, _ = bounded(upload, "model upload", timeout_s)
    if not ok:
        return None

    export_id = uuid.uuid4().hex
    attempt = {"n": 0}

    def register() -> str:
        from mlflow.exceptions import MlflowException

        c = mlflow_client(tracking_uri)
        attempt["n"] += 1
        if attempt["n"] > 1:  # a retry must not register the same export twice
            for mv in c.search_model_versions(f"run_id = '{run_id}'"):
                if mv.name == registered_name and (mv.tags or {}).get("rayspeed.export_id") == export_id:
                    return str(mv.version)
        try:
            c.get_registered_model(registered_name)
        except MlflowException:
            try:
                c.create_registered_model(registered_name, tags={"rayspeed.format": "rayspeed-model/1"},
                                          description="rayspeed Transformer; load with "
                                                      "rayspeed.model.export.load_model")
            except MlflowException:
                c.get_registered_model(registered_name)  # created concurrently: fine if it exists now
        run = c.get_run(run_id)
        source = run.info.artifact_uri.rstrip("/") + "/" + MODEL_ARTIFACT
        tags = metric_tags(metrics or {})
        tags.update({"rayspeed.job": run.data.tags.get("rayspeed.job", ""), "rayspeed.run_id": run_id,
                     "rayspeed.export_id": export_id})
        tags.update(extra_tags or {})
        mv = c.create_model_version(registered_name, source=source, run_id=run_id, tags=tags,
                                    description=f"run {run.info.run_name} ({run_id})")
        try:
            c.set_tag(run_id, "rayspeed.registered_version", f"{registered_name}/{mv.version}")
        except Exception:
            pass
        return str(mv.version)

    ok, version = bounded(register, "model registration", timeout_s, attempts=3)
    if ok:
        log.info("registered %s version %s from run %s", registered_name, version, run_id)
    return version if ok else None


def set_alias(tracking_uri: str, registered_name: str, version: str | int, alias: str = CHAMPION,
              timeout_s: float = 60.0) -> bool:
    """Point `alias` (default champion) at version. True if done."""
    ok, _ = bounded(
        lambda: mlflow_client(tracking_uri).set_registered_model_alias(registered_name, alias, str(version)),
        f"set alias {alias}", timeout_s)
    return ok


def get_alias_version(tracking_uri: str, registered_name: str, alias: str = CHAMPION,
                      timeout_s: float = 60.0) -> Optional[str]:
    """The version the alias points at, or None (no such model/alias, or the server is away)."""
    def get() -> Optional[str]:
        from mlflow.exceptions import MlflowException

        try:
            return str(mlflow_client(tracking_uri).get_model_version_by_alias(registered_name, alias).version)
        except MlflowException:
            return None

    ok, v = bounded(get, f"read alias {alias}", timeout_s, attempts=1)
    return v if ok else None


def version_metrics(tracking_uri: str, registered_name: str, version: str | int,
                    timeout_s: float = 60.0) -> Optional[dict[str, float]]:
    """The metrics a version was registered with (its `metric.*` tags), e.g. to compare with the champion."""
    def get() -> dict[str, float]:
        mv = mlflow_client(tracking_uri).get_model_version(registered_name, str(version))
        out = {}
        for k, v in (mv.tags or {}).items():
            if k.startswith("metric."):
                try:
                    out[k[len("metric."):]] = float(v)
                except ValueError:
                    pass
        return out

    ok, v = bounded(get, "read version metrics", timeout_s, attempts=1)
    return v if ok else None


def model_uri(registered_name: str, alias_or_version: str | int = CHAMPION) -> str:
    """models:/name@alias or models:/name/version, for mlflow.artifacts.download_artifacts."""
    s = str(alias_or_version)
    return f"models:/{registered_name}/{s}" if s.isdigit() else f"models:/{registered_name}@{s}"
