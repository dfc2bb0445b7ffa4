"""A rank killed at each point of a checkpoint save, with 2 workers under Ray Train, in both checkpoint modes: the
restart resumes from the newest checkpoint that committed (the one being written only when its manifest made it),
and the loss curve continues exactly the uninterrupted run's. In async mode every point after before_shards is in the
background writer while training goes on. (`make test-slow`: eleven Ray runs.)"""

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

# point -> (rank killed, checkpoint the restart must resume from). Rank 1 for the sync saves: rank 0's part in the
# commit is the same either way (it never commits while another rank is dead). In async saves rank 0 is also the
# committer on its background thread: it dies there at the manifest points.
POINTS = {
    "before_shards": (1, "checkpoint_step00000004"),
    "between_shards": (1, "checkpoint_step00000004"),
    "after_shards": (1, "checkpoint_step00000004"),
    "before_manifest": (1, "checkpoint_step00000004"),
    "after_manifest": (1, "checkpoint_step00000008"),
}
ASYNC_RANK = {"before_manifest": 0, "after_manifest": 0}
CASES = [(mode, point) for mode in ("sync", "async") for point in POINTS]


@pytest.fixture(scope="module")
def reference(ray_head, tmp_path_factory):
    home = tmp_path_factory.mktemp("reference")
    r, summary = run_job(home, [*COMMON, "--set", "name=kp-reference"], ray_head.address)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(metric_history(home, summary["mlflow_run_id"], "train/loss"))


@pytest.mark.parametrize("mode,point", CASES)
def test_kill_inside_a_save_resumes_from_the_newest_committed_checkpoint(ray_head, tmp_path, reference, mode, point):
    rank, expected = POINTS[point]
    if mode == "async":
        rank = ASYNC_RANK.get(point, rank)
    r, summary = run_job(tmp_path, [*COMMON, "--set", f"name=kp-{mode}-{point.replace('_', '-')}", "--set",
                                    f"resilience.checkpoint_mode={mode}", "--set",
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
        assert value == pytest.approx(reference[step], rel=1e-5), (mode, point, step, value, reference[step])
    if mode == "async":
        assert "checkpoints: resilience.checkpoint_mode async -> async" in out
        assert summary["checkpoint_write_s"] is not None and summary["checkpoint_bytes"] > 0
        for key in ("checkpoint/stall_s", "checkpoint/write_s", "checkpoint/bytes", "perf/checkpoint_stall_s"):
            assert metric_history(tmp_path, summary["mlflow_run_id"], key), key
