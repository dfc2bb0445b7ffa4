"""The issue's DPO scenario through the real entry point on a real local Ray cluster: the example's chat model
(scripts/make_tiny_chat_model.py: a Llama with its own tokenizer and chat template) preference-tuned on its
conversational pairs under Ray Train + DeepSpeed ZeRO-2 on 2 CPU workers (configs/tiny-dpo-cpu.yaml). Step 1's loss
is ln 2 (the reference is the initial weights, precomputed before the first step), and training raises
rewards/accuracies and rewards/margins and lowers val/loss; the same job with rank 1 killed at step 5 restarts,
reads the reference file instead of scoring the pairs again, resumes its step-4 checkpoint and logs the
uninterrupted run's losses and rewards to 1e-5. The uninterrupted job also scores its last checkpoint on a local
lm-eval task (eval.harness) in a Ray task of its own, beside the training workers."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from _cluster import ROOT, metric_history, run_job

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]
CONFIG = ROOT / "configs" / "tiny-dpo-cpu.yaml"


def _example(out):
    spec = importlib.util.spec_from_file_location("make_tiny_chat_model", ROOT / "scripts" / "make_tiny_chat_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.save(str(out))


def _sets(made, cache, name):
    return ["--config", str(CONFIG), "--set", f"model.pretrained={made['model']}", "--set", f"name={name}",
            "--set", f"data.path={made['preferences']}/*.jsonl", "--set", f"data.cache_dir={cache}",
            "--set", "train.max_steps=8", "--set", "train.warmup_steps=0", "--set", "train.eval_every_steps=4",
            "--set", "resilience.checkpoint_every_steps=4", "--set", "tracking.log_every_steps=1"]


def _series(home, run_id, key):
    per_step = dict(metric_history(home, run_id, key))
    return [per_step[s] for s in sorted(per_step)]


def test_a_dpo_job_learns_the_preferences_and_resumes_exactly(ray_head, tmp_path):
    from _facts_task import write_task

    made = _example(tmp_path / "example")
    whole, killed, cache = tmp_path / "whole", tmp_path / "killed", tmp_path / "cache"
    harness = ["--set", "eval.harness.tasks=[facts]", "--set", f"eval.harness.include_path={write_task(tmp_path)}",
               "--set", "eval.harness.every_checkpoints=0"]
    r, s = run_job(whole, [*_sets(made, cache, "dpo"), *harness], ray_head.address)
    assert r.returncode == 0 and s["status"] == "finished", r.stdout[-3000:] + r.stderr[-3000:]
    assert s["layout"]["dp"] == 2 and s["world_size"] == 2
    assert "dpo reference: 216 train pairs scored with the initial weights" in r.stderr
    run_id = s["mlflow_run_id"]
    loss, acc = _series(whole, run_id, "train/loss"), _series(whole, run_id, "rewards/accuracies")
    margins = _series(whole, run_id, "rewards/margins")
    assert len(loss) == 8 and loss[0] == pytest.approx(math.log(2), abs=1e-6) and acc[0] == 0.0
    assert acc[-1] > 0.9 and margins[-1] > margins[0] + 0.5 and loss[-1] < loss[0] - 0.2, (acc, margins, loss)
    val = _series(whole, run_id, "val/loss")
    assert len(val) == 2 and val[-1] < val[0] < math.log(2) - 0.2, val
    assert _series(whole, run_id, "val/rewards/accuracies")[-1] > 0.9
    assert "reward accuracy" in r.stderr  # the step log line of a DPO job
    (step, acc_facts), = metric_history(whole, run_id, "eval/facts/acc")  # the final model only (every 0)
    assert step == 8 and 0.0 <= acc_facts <= 1.0, r.stderr[-3000:]

    r, s2 = run_job(killed, [*_sets(made, cache, "dpo"), "--set", "chaos.kill_rank_at_step={rank: 1, step: 5}"],
                    ray_head.address)
    assert r.returncode == 0 and s2["restarts"] == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from checkpoint_step00000004 at step 4" in r.stderr
    assert "scored with the initial weights" not in r.stderr  # the cache of the first job holds the reference
    assert r.stderr.count("dpo reference: 216 train pairs read from") == 2  # the first attempt and the restart
    for key in ("train/loss", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        torch.testing.assert_close(torch.tensor(_series(killed, s2["mlflow_run_id"], key)),
                                   torch.tensor(_series(whole, run_id, key)), rtol=0, atol=1e-5, msg=key)
