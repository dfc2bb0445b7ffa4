"""The run's training and validation data as MLflow dataset inputs (the run page's "Datasets" section).

    log_dataset_inputs(client, run_id, [{"context": "training", "name": ..., "source_type": "files", "source": ...,
                                         "digest": ..., "num_documents": ..., "num_tokens": ...}, ...])

Each input is an MLflow Dataset: its name, the corpus's content hash as digest, the source (paths, a hub name) and
a profile with the documents and tokens; the input tag `mlflow.data.context` says training or validation. A run
that already has an input with the same name and digest (a restart, a resubmission) is not given it twice.
"""

from __future__ import annotations

import json
from typing import Any

CONTEXT_TAG = "mlflow.data.context"


def to_mlflow(item: dict[str, Any]) -> Any:
    from mlflow.entities import Dataset, DatasetInput, InputTag

    from rayspeed.redact import redact_mapping

    item = redact_mapping(item)  # a source URI or path may carry credentials, like everything else sent to MLflow

    source = {"source": item["source"], "split": item.get("split"), "format": item.get("format"),
              "tokenizer": item.get("tokenizer")}
    profile = {"num_documents": item.get("num_documents"), "num_tokens": item.get("num_tokens")}
    schema = {"mlflow_tensorspec": {"features": json.dumps([{"name": "input_ids", "type": "tensor",
                                                              "tensor-spec": {"dtype": "int64", "shape": [-1]}}]),
                                    "targets": None}}
    ds = Dataset(name=item["name"], digest=str(item["digest"]), source_type=f"rayspeed-{item['source_type']}",
                 source=json.dumps(source), schema=json.dumps(schema), profile=json.dumps(profile))
    return DatasetInput(ds, tags=[InputTag(key=CONTEXT_TAG, value=item["context"])])


def log_dataset_inputs(client: Any, run_id: str, items: list[dict[str, Any]]) -> int:
    """Log the inputs the run does not have yet; returns how many were logged."""
    have = {(i.dataset.name, i.dataset.digest) for i in (client.get_run(run_id).inputs.dataset_inputs or [])}
    fresh = [to_mlflow(i) for i in items if (i["name"], str(i["digest"])) not in have]
    if fresh:
        client.log_inputs(run_id, datasets=fresh)
    return len(fresh)
