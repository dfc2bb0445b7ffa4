"""MLflow internals rayspeed uses (written for mlflow 3.17); each says why and when it can go."""

from __future__ import annotations

import contextlib
from typing import Iterator

MLFLOW_PROCESS_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_ID")


@contextlib.contextmanager
def mlflow_process_state() -> Iterator[None]:
    """Put back, after the block, MLflow's process-wide store settings exactly as they were: the tracking and
    registry URI globals, the active experiment, and the MLFLOW_* variables the setters export for subprocesses."""
    import os

    from mlflow.tracking import fluent
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    saved = (tracking_utils._tracking_uri, registry_utils._registry_uri, fluent._active_experiment_id)
    env = {k: os.environ.get(k) for k in MLFLOW_PROCESS_ENV}
    try:
        yield
    finally:
        tracking_utils._tracking_uri, registry_utils._registry_uri, fluent._active_experiment_id = saved
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def mlflow_process_store(uri: str) -> Iterator[None]:
    """MLflow's process-wide tracking and registry URIs at `uri` for the block, then as they were.
    `mlflow.<flavor>.log_model`, `register_model` and `models:/` URIs only resolve against the process-wide store;
    left set, they would send every later MlflowClient without an explicit registry URI (and every later job in a
    long-lived driver) to this job's store."""
    import mlflow

    with mlflow_process_state():
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        yield
