"""A GRPO job whose trainer worker is killed (rank 1 at step 6, `chaos.kill_rank_at_step`) on a real local Ray
cluster restarts, resumes its step-4 checkpoint and logs the uninterrupted job's rewards, losses and completion
lengths at every step to 1e-6: a step's sampling is seeded by (seed, step, rank), so the resumed job samples what the
uninterrupted one sampled from the same weights (configs/tiny-grpo-cpu.yaml, 2 workers, 8 steps)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from _cluster import ROOT, metric_history, run_job

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]
CONFIG = ROOT / "configs" / "tiny-grpo-cpu.yaml"
KEYS = ("reward", "reward_std", "train/loss", "completions/mean_length", "rewards/exact_number/mean")


def _series(home, run_id, key):
    per_step = dict(metric_history(home, run_id, key))
    return [per_step[s] for s in sorted(per_step)]


def test_a_killed_trainer_worker_resumes_the_same_rollouts(ray_head, tmp_path):
    spec = importlib.util.spec_from_file_location("make_tiny_sum_model", ROOT / "scripts" / "make_tiny_sum_model.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    made = example.save(str(tmp_path / "example"))
    sets = ["--config", str(CONFIG), "--set", f"model.pretrained={made['model']}",
            "--set", f"data.path={made['prompts']}/sums.jsonl", "--set", "train.max_steps=8",
            "--set", "resilience.checkpoint_every_steps=4", "--set", "tracking.log_every_steps=1"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    r, s = run_job(whole, sets, ray_head.address)
    assert r.returncode == 0 and s["status"] == "finished" and s["restarts"] == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r, s2 = run_job(killed, [*sets, "--set", "chaos.kill_rank_at_step={rank: 1, step: 6}"], ray_head.address)
    assert r.returncode == 0 and s2["status"] == "finished" and s2["restarts"] == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from checkpoint_step00000004 at step 4" in r.stderr
    for key in KEYS:
        got, want = _series(killed, s2["mlflow_run_id"], key), _series(whole, s["mlflow_run_id"], key)
        assert len(want) == 8, (key, want)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6, msg=key)


def test_a_reward_that_raises_ends_the_ray_job_without_restarts(ray_head, tmp_path):
    """Rank 1's reward function raises at the second step (tests/fixtures/hooks/failing_rewards.py): the job ends
    at once with exit 1, status reward_failed and the function's one-line message, none of its three restarts
    spent (each would score the same records the same way)."""
    import json

    spec = importlib.util.spec_from_file_location("make_tiny_sum_model", ROOT / "scripts" / "make_tiny_sum_model.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    made = example.save(str(tmp_path / "example"), steps=0)
    hooks = str(ROOT / "tests" / "fixtures" / "hooks")
    sets = ["--config", str(CONFIG), "--set", f"model.pretrained={made['model']}",
            "--set", f"data.path={made['prompts']}/sums.jsonl", "--set", "train.max_steps=4",
            "--set", "train.grpo.rewards=[failing_rewards:fails_on_rank_one]",
            "--set", "cluster.env=" + json.dumps({"PYTHONPATH": hooks}), "--set", "resilience.max_failures=3"]
    r, s = run_job(tmp_path / "home", sets, ray_head.address, env_extra={"PYTHONPATH": hooks})
    assert r.returncode == 1 and s["status"] == "reward_failed" and s["restarts"] == 0, r.stdout[-3000:] + \
        r.stderr[-3000:]
    assert "reward function fails_on_rank_one raised ValueError: no answer checker for this record" in r.stderr
    assert "resumed from" not in r.stderr
