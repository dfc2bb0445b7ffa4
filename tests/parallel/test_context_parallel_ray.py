"""The issue's acceptance scenario through the real entry point on a real local Ray cluster: a locally made Llama
checkpoint that saw 64 positions trains on packed 256-token sequences (its context stretched: a larger
model.max_position_embeddings and linear RoPE scaling, both apart from its config.json) with `parallel.cp: 2`
under Ray Train + DeepSpeed ZeRO-2 on 2 CPU workers, each holding half of every sequence; the loss is finite and
falls, and the run records the layout with cp."""

from __future__ import annotations

import math

import pytest
import yaml

from _cluster import ROOT, metric_history, run_job
from _hf_models import tiny

pytestmark = pytest.mark.ray
CONFIG = ROOT / "configs" / "tiny-pretrained-cpu.yaml"


def test_a_cp2_job_trains_past_the_checkpoints_positions(ray_head, tmp_path):
    model_dir = tmp_path / "tiny-llama-64"
    tiny.main([str(model_dir), "--tokenizer", "--max-positions", "64"])
    job = yaml.safe_load(CONFIG.read_text())
    job["name"] = "cp2-long"
    job["model"].update(pretrained=str(model_dir), seq_len=256, max_position_embeddings=256,
                        rope_scaling={"rope_type": "linear", "factor": 4.0})
    job["data"]["document_masking"] = True  # packed files: documents masked across the two parts
    job["train"].update(max_steps=8, global_batch_size=2, lr=2e-3, min_lr=2e-4, warmup_steps=0)
    job["parallel"] = {"cp": 2, "zero_stage": 2, "micro_batch_size": 2}
    job["resilience"]["checkpoint_every_steps"] = 0
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    r, summary = run_job(tmp_path, ["--config", str(path)], ray_head.address)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert summary["status"] == "finished" and summary["world_size"] == 2
    assert (summary["layout"]["dp"], summary["layout"]["cp"]) == (1, 2)
    losses = [v for _, v in metric_history(tmp_path, summary["mlflow_run_id"], "train/loss")]
    print(f"\ncp2 losses over 256-token sequences (the checkpoint saw 64 positions): "
          f"{', '.join(f'{v:.4f}' for v in losses)}")
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.1
