"""The issue's acceptance scenario, through the real entry point on a real local Ray cluster: a job with
model.pretrained pointing at a Hugging Face checkpoint made locally (scripts/make_tiny_hf_model.py) trains under
Ray Train + DeepSpeed ZeRO-2 with 2 CPU workers; its first logged loss is the checkpoint's own loss (transformers
on the same first batch), the registered version loads in transformers, and `rayspeed export` of the last
checkpoint is the same model."""

from __future__ import annotations

import math

import pytest
import torch

from _cluster import ROOT, metric_history, run_job
from _hf_models import first_batch_loss, tiny

pytestmark = pytest.mark.ray
CONFIG = str(ROOT / "configs" / "tiny-pretrained-cpu.yaml")
SEQ, BATCH, SEED = 128, 8, 1234


def test_pretrained_job_starts_from_the_checkpoint_and_registers_a_transformers_model(ray_head, tmp_path):
    import mlflow
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "tiny-llama"
    tiny.main([str(model_dir), "--tokenizer"])
    r, summary = run_job(tmp_path, ["--config", CONFIG, "--set", f"model.pretrained={model_dir}",
                                    "--set", "train.max_steps=10"], ray_head.address)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert summary["status"] == "finished" and summary["world_size"] == 2 and summary["layout"]["zero_stage"] == 2

    expected, windows = first_batch_loss(tmp_path, model_dir, SEQ, BATCH, SEED)
    (step, first), *_ = metric_history(tmp_path, summary["mlflow_run_id"], "train/loss")
    print(f"\nfirst logged train/loss {first:.6f} (step {step}); transformers on the same batch {expected:.6f}; "
          f"ln(256) {math.log(256):.4f}")
    assert step == 1 and first == pytest.approx(expected, rel=1e-5)
    assert abs(first - math.log(256)) > 0.5  # not a freshly initialised model

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    version = summary["registered_model_version"]
    local = mlflow.artifacts.download_artifacts(f"models:/rayspeed-tiny-pretrained-cpu/{version}",
                                                dst_path=str(tmp_path / "dl"))
    registered = AutoModelForCausalLM.from_pretrained(f"{local}/model", dtype=torch.float32).eval()
    print(f"registered version {version} loads in transformers as {type(registered).__name__}")

    from rayspeed.cli import main as _cli

    def export_main(argv):
        return _cli(["export", *argv])


    out = tmp_path / "exported"
    assert export_main([str(tmp_path / "runs" / "tiny-pretrained-cpu"), "--format", "hf", str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(windows[:2, :-1]).logits, registered(windows[:2, :-1]).logits,
                                   rtol=1e-5, atol=1e-5)
