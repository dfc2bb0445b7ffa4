"""The job's data as MLflow dataset inputs, on a real SQLite store: what the run page's "Datasets" section shows."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np

from rayspeed.config.load import parse
from rayspeed.data import build_token_file
from rayspeed.tracking.dataset_inputs import log_dataset_inputs
from rayspeed.train.data_setup import Corpus, dataset_inputs


def test_training_and_validation_inputs_with_digest_and_sizes(tmp_path):
    from mlflow import MlflowClient

    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text("hello world " * (50 + i))
    cfg = parse({"name": "inputs", "data": {"source": "files", "path": str(tmp_path / "doc*.txt"),
                                            "val_fraction": 0.3},
                 "model": {"seq_len": 16}})
    tf = build_token_file("files", str(tmp_path / "doc*.txt"), "bytes", str(tmp_path / "cache"))
    items = dataset_inputs(Corpus(tf), cfg)
    train, val = items
    assert (train["context"], val["context"]) == ("training", "validation")
    assert train["num_tokens"] + val["num_tokens"] == tf.num_tokens == 3 + sum(12 * (50 + i) for i in range(3))
    assert train["num_documents"] == 3 and val["num_documents"] == 1  # the last document holds the val tail
    assert train["digest"] == tf.content_hash[:32] and train["source"] == str(tmp_path / "doc*.txt")

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("x", artifact_location=(tmp_path / "artifacts").as_uri()))
    assert log_dataset_inputs(client, run.info.run_id, items) == 2
    assert log_dataset_inputs(client, run.info.run_id, items) == 0  # a restart does not log them twice
    got = client.get_run(run.info.run_id).inputs.dataset_inputs
    assert len(got) == 2
    by_context = {i.tags[0].value: i.dataset for i in got}
    ds = by_context["training"]
    assert ds.name == "inputs-training" and ds.digest == tf.content_hash[:32] and ds.source_type == "rayspeed-files"
    assert json.loads(ds.profile) == {"num_documents": 3, "num_tokens": train["num_tokens"]}
    assert json.loads(ds.source)["source"] == str(tmp_path / "doc*.txt")
    assert by_context["validation"].name == "inputs-validation"


def test_an_own_validation_split_is_its_own_input(tmp_path):
    ids = SimpleNamespace(content_hash="a" * 64, num_documents=4, num_tokens=100, doc_starts=np.array([0, 10, 40, 70]),
                          source="hf:x[train]")
    cfg = parse({"name": "own", "data": {"source": "hf", "dataset": "org/x", "val_split": "validation"},
                 "model": {"seq_len": 8}})
    from rayspeed.data.token_split import TokenSplit

    class _TF(SimpleNamespace):
        def whole(self, name="train"):
            return TokenSplit(np.zeros(self.num_tokens, np.int64), 0, self.num_tokens, name, self.content_hash,
                              None, self.doc_starts)

    train = _TF(**vars(ids))
    val = _TF(**{**vars(ids), "content_hash": "b" * 64, "num_documents": 1, "num_tokens": 30,
                 "doc_starts": np.array([0])})
    items = dataset_inputs(Corpus(train, val), cfg)
    assert [(i["context"], i["split"], i["digest"], i["num_tokens"], i["num_documents"]) for i in items] == [
        ("training", "train", "a" * 32, 100, 4), ("validation", "validation", "b" * 32, 30, 1)]
    assert items[0]["source"] == "org/x" and items[0]["source_type"] == "hf"


def test_a_source_with_credentials_reaches_mlflow_masked():
    from rayspeed.tracking.dataset_inputs import to_mlflow

    item = {"context": "training", "name": "corpus", "source_type": "files", "digest": "0123abcd" * 4,
            "source": "s3://AKIAEXAMPLE:wJalrXUtnFEMIsecret@bucket/corpus/*.jsonl", "num_documents": 3,
            "num_tokens": 40}
    ds = to_mlflow(item).dataset
    assert "wJalrXUtnFEMIsecret" not in ds.source and "bucket/corpus/*.jsonl" in ds.source
    assert ds.digest == "0123abcd" * 4 and ds.name == "corpus"
