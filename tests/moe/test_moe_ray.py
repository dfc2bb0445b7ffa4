"""The issue's acceptance scenario through the real entry point on a real local Ray cluster: a locally made
Qwen3-MoE-style checkpoint (a dense layer among the sparse ones) fine-tuned under Ray Train + DeepSpeed ZeRO-2 on
2 CPU workers with `parallel.ep: 2` (each worker holds half of every layer's experts). The run records ep 2, logs
moe/aux_loss, moe/load_imbalance and moe/dropped_tokens at every step and, checkpointing every step, each step's
tokens per expert, whose busiest expert over their mean is that step's moe/load_imbalance; the same job with rank 1
killed at step 3 restarts, resumes its step-2 checkpoint and logs the uninterrupted run's losses to
1e-5; the registered model loads in transformers as a Qwen3MoeForCausalLM with the exported weights' logits, and
`rayspeed export --format hf` of the last checkpoint (its experts gathered from both ranks' files) gives the same."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from _cluster import ROOT, metric_history, run_job

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]
CONFIG = ROOT / "configs" / "tiny-pretrained-cpu.yaml"


def _sets(model_dir, name):
    return ["--config", str(CONFIG), "--set", f"model.pretrained={model_dir}", "--set", f"name={name}",
            "--set", "model.seq_len=32", "--set", "train.global_batch_size=4", "--set", "train.max_steps=4",
            "--set", "train.lr=1e-3", "--set", "parallel.ep=2", "--set", "parallel.zero_stage=2",
            "--set", "resilience.checkpoint_every_steps=2", "--set", "tracking.log_every_steps=1",
            "--set", "tracking.loss_landscape=false", "--set", "tracking.charts_every_checkpoints=0"]


def _losses(home, run_id):
    per_step = dict(metric_history(home, run_id, "train/loss"))
    return [per_step[s] for s in sorted(per_step)]


def test_an_ep2_job_fine_tunes_resumes_and_exports_a_qwen3_moe(ray_head, tmp_path):
    import mlflow
    import transformers

    from rayspeed.compat import mlflow_process_store
    from rayspeed.model.export import load_model

    torch.manual_seed(3)
    config = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=128, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=24, mlp_only_layers=[1], tie_word_embeddings=False)
    model_dir = tmp_path / "tiny-qwen3-moe"
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(model_dir)

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    # A checkpoint, hence a moe/expert_load/ file, at every step: each file then holds the very counts of the step
    # whose moe/load_imbalance is logged (the cadence changes no loss: the killed run's every 2 steps matches).
    per_step = ["--set", "resilience.checkpoint_every_steps=1", "--set", "tracking.charts_every_checkpoints=1"]
    r, s = run_job(whole, [*_sets(model_dir, "moe-ep2"), *per_step], ray_head.address)
    assert r.returncode == 0 and s["status"] == "finished", r.stdout[-3000:] + r.stderr[-3000:]
    assert (s["layout"]["dp"], s["layout"]["ep"]) == (2, 2)
    assert "expert_parallel: ep 2: experts 0..1 of 2 MoE layers on this rank" in r.stderr
    run_id = s["mlflow_run_id"]
    for key in ("moe/aux_loss", "moe/load_imbalance", "moe/dropped_tokens"):
        assert [step for step, _ in metric_history(whole, run_id, key)] == [1, 2, 3, 4], key

    r, s2 = run_job(killed, [*_sets(model_dir, "moe-ep2"), "--set", "chaos.kill_rank_at_step={rank: 1, step: 3}"],
                    ray_head.address)
    assert r.returncode == 0 and s2["restarts"] == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from checkpoint_step00000002 at step 2" in r.stderr
    torch.testing.assert_close(torch.tensor(_losses(killed, s2["mlflow_run_id"])),
                               torch.tensor(_losses(whole, run_id)), rtol=0, atol=1e-5)

    with mlflow_process_store(f"sqlite:///{whole / 'mlflow.db'}"):
        local = mlflow.artifacts.download_artifacts(
            f"models:/rayspeed-moe-ep2/{s['registered_model_version']}", dst_path=str(tmp_path / "dl"))
        loads = {step: json.loads(mlflow.artifacts.load_text(f"runs:/{run_id}/moe/expert_load/step_{step:07d}.json"))
                 for step in (1, 2, 3, 4)}
    layers = dict(metric_history(whole, run_id, "moe/load_imbalance_layer"))
    for step, logged in metric_history(whole, run_id, "moe/load_imbalance"):
        assert loads[step]["steps"] == [step, step] and loads[step]["layers"] == [0, 2], loads[step]
        counts = torch.tensor(loads[step]["tokens_per_expert"], dtype=torch.float64)
        assert counts.sum(1).tolist() == [4 * 32 * 2] * 2  # each token of the global batch, on its 2 experts
        per_layer = counts.max(1).values / counts.mean(1)  # the busiest expert over the mean, per MoE layer
        assert logged == pytest.approx(float(per_layer.max()), rel=1e-12), (step, counts)
        assert layers[step] == loads[step]["layers"][int(per_layer.argmax())]
    exported = tmp_path / "export-hf"
    ckpt = whole / "runs" / "moe-ep2" / "checkpoint_step00000004"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(whole), "RAYSPEED_HOME": str(whole),
           "PYTHONPATH": str(ROOT / "platform")}
    r = subprocess.run([sys.executable, "-m", "rayspeed", "export", str(ckpt), str(exported), "--format", "hf"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "wrote" in r.stdout, r.stderr[-2000:]

    trained = load_model(str(whole / "runs" / "moe-ep2" / "model"))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained(ids)
        for folder in (f"{local}/model", exported):
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
            assert type(hf).__name__ == "Qwen3MoeForCausalLM"
            torch.testing.assert_close(hf(ids).logits, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{folder}: {m}")
        base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)(ids).logits
    assert (base - want).abs().max() > 1e-4  # it trained
