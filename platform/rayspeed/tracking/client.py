"""The one place an MLflow client is made: tracking and registry on the same store (a registered model lives
where its run does). mlflow is imported here, lazily, so planning and config checks never pay for it."""

from __future__ import annotations

from typing import Any, Optional


def mlflow_client(uri: Optional[str]) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)
