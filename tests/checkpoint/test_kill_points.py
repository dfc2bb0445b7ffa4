"""A rank killed at each point of a checkpoint save, with 2 workers under Ray Train: the restart resumes from the
newest checkpoint that committed (the one being written only when its manifest made it), and the loss curve
continues exactly the uninterrupted run's. (`make test-slow`: five Ray runs.)"""

from __future__ import annotations

import re

import pytest

from _cluster import ROOT, metric_history, run_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
COMMON = ["--config", TINY, "--set", "train.max_steps=12", "--set", "resilience.checkpoint_every_steps=4",
          "--set", "tracking.log_every_steps=1", "--set", "train.eval_every_steps=0", "--set",
          "tracking.loss_landscape=false", "--set", "tracking.charts_every_checkpoints=0", "--set",
          "parallel.zero_stage=2"]
RESUMED = re.compile(r"resumed from (checkpoint_step\d+) at step (\d+)")

# point -> (rank killed, checkpoint the restart must resume from). Rank 1: rank 0 holds the MLflow queue, which a
# SIGKILL of rank 0 itself would cut short (up to its 2 s coalescing window of metrics); rank 0's part in the
# commit is the same either way: it never commits while another rank is dead.
POINTS = {
    "before_shards": (1, "checkpoint_step00000004"),
    "between_shards": (1, "checkpoint_step00000004"),
    "before_manifest": (1, "checkpoint_step00000004"),
    "after_manifest": (1, "checkpoint_step00000008"),
}


@pytest.fixture(scope="module")
def reference(ray_head, tmp_path_factory):
    home = tmp_path_factory.mktemp("reference")
    r, summary = run_job(home, [*COMMON, "--set", "name=kp-reference"], ray_head.address)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(metric_history(home, summary["mlflow_run_id"], "train/loss"))


@pytest.mark.parametrize("point", list(POINTS))
def test_kill_inside_a_save_resumes_from_the_newest_committed_checkpoint(ray_head, tmp_path, reference, point):
    rank, expected = POINTS[point]
    r, summary = run_job(tmp_path, [*COMMON, "--set", f"name=kp-{point.replace('_', '-')}", "--set",
                                    f"chaos.kill_rank_in_checkpoint={{rank: {rank}, step: 8, point: {point}}}"],
                         ray_head.address)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert f"inside the checkpoint write of step 8 ({point})" in out
    assert RESUMED.search(out).group(1) == expected, out[-4000:]
    assert summary["restarts"] == 1 and summary["steps"] == 12
    loss = metric_history(tmp_path, summary["mlflow_run_id"], "train/loss")
    assert [s for s, _ in loss] == list(range(1, 13))  # every step once, replayed ones included
    for step, value in loss:
        assert value == pytest.approx(reference[step], rel=1e-5), (point, step, value, reference[step])
