"""On a real Ray cluster: a multi-file JSONL chat corpus tokenized by a Ray Data pipeline gives byte-identical shards
to the local process pool (`--launcher local`), and the chat fine-tuning example runs end to end through
jobs/train.py under Ray Train + DeepSpeed (2 CPU workers): the assistant-token loss falls, the data are the run's
MLflow dataset inputs, and transformers loads the registered version and answers a question."""

from __future__ import annotations

import importlib.util
import json

import pytest

from _cluster import ROOT, metric_history, run_job

pytestmark = pytest.mark.ray
_gen = importlib.util.spec_from_file_location("chat_generate", ROOT / "scripts" / "chat_generate.py")
chat_generate = importlib.util.module_from_spec(_gen)
_gen.loader.exec_module(chat_generate)


@pytest.fixture(scope="module")
def example(examples_home):
    return examples_home[1]


def test_ray_data_and_the_process_pool_write_byte_identical_shards(ray_head, example, tmp_path, monkeypatch):
    import ray

    from rayspeed.data import DataSpec, build_token_file
    from rayspeed.data import records as records_mod

    monkeypatch.setattr(records_mod, "UNIT_BYTES", 40_000)  # several units per file: 4 files, ~12 units
    spec = DataSpec(source="files", path=(f"{example['chats']}/*.jsonl",), tokenizer=example["model"], format="chat")
    ray.init(address=ray_head.address, logging_level="WARNING")
    try:
        on_ray = build_token_file(spec=spec, cache_dir=str(tmp_path / "ray"), executor="ray")
    finally:
        ray.shutdown()
    pooled = build_token_file(spec=spec, cache_dir=str(tmp_path / "pool"), executor="pool")
    index = json.loads((tmp_path / "ray" / f"shards-{on_ray.cache_key}" / "index.json").read_text())
    assert index["executor"] == "ray" and len(index["shards"]) > 4
    ray_bytes = [open(p, "rb").read() for p in on_ray.shards.paths]
    pool_bytes = [open(p, "rb").read() for p in pooled.shards.paths]
    print(f"\n{len(ray_bytes)} shards, {sum(map(len, ray_bytes))} bytes: Ray Data == process pool: "
          f"{ray_bytes == pool_bytes}")
    assert ray_bytes == pool_bytes and on_ray.content_hash == pooled.content_hash
    assert on_ray.num_documents == example["records"] and on_ray.mask is not None


def test_chat_finetune_example_end_to_end(ray_head, example, tmp_path):
    from mlflow import MlflowClient

    config = str(ROOT / "configs" / "tiny-chat-finetune-cpu.yaml")
    r, summary = run_job(tmp_path, ["--config", config, "--set", f"model.pretrained={example['model']}",
                                    "--set", f"data.path={example['chats']}/*.jsonl", "--set", "train.max_steps=150",
                                    "--set", "train.eval_every_steps=0"], ray_head.address, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert summary["status"] == "finished" and summary["world_size"] == 2 and summary["launcher"] == "ray"
    assert "tokenized files:" in r.stderr and ", ray)" in r.stderr.split("tokenized files:")[1].splitlines()[0]
    losses = metric_history(tmp_path, summary["mlflow_run_id"], "train/loss")
    (s0, first), (s1, last) = losses[0], losses[-1]
    print(f"\nassistant-token loss: step {s0} {first:.4f} -> step {s1} {last:.4f}; val {summary['val_loss']:.4f}")
    assert last < 0.5 * first and summary["val_loss"] < 0.5 * first

    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(summary["mlflow_run_id"])
    inputs = {i.tags[0].value: i.dataset for i in run.inputs.dataset_inputs}
    assert set(inputs) == {"training", "validation"}
    profile = json.loads(inputs["training"].profile)
    assert profile["num_tokens"] > 0 and profile["num_documents"] > 500
    assert inputs["training"].source_type == "rayspeed-files" and len(inputs["training"].digest) == 32

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    name = "rayspeed-tiny-chat-finetune-cpu"
    model_dir, tok_dir = chat_generate.model_dirs(f"models:/{name}/{summary['registered_model_version']}", uri,
                                                  str(tmp_path / "dl"))
    question = "What is the capital of Japan?"
    answer = chat_generate.answer(model_dir, question, 24, tok_dir)
    import mlflow

    assert mlflow.get_tracking_uri() != uri  # nothing process-wide was changed for the tests that follow
    print(f"registered version {summary['registered_model_version']}: Q: {question} A: {answer}")
    assert answer and "<|" not in answer and len(answer.split()) >= 3
