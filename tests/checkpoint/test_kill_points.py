"""A rank killed at each point of a checkpoint save, with 2 workers under Ray Train, in both checkpoint modes: every
restart resumes from the newest checkpoint that committed (the one being written only when its manifest made it),
and the loss curve continues exactly the uninterrupted run's. In async mode every point after before_shards is in the
background writer while training goes on. One job per mode drills the five points in turn (a list of
chaos.kill_rank_in_checkpoint drills, one restart each), against the session's uninterrupted run (conftest's
zero2_reference). (`make test-slow`: two Ray runs.)"""

from __future__ import annotations

import re

import pytest

from _cluster import ZERO2_REFERENCE, metric_history, run_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]
STEPS = 30
COMMON = [*ZERO2_REFERENCE, "--set", "resilience.checkpoint_every_steps=4", "--set", "resilience.max_failures=5"]
RESUMED = re.compile(r"resumed from (checkpoint_step\d+) at step (\d+)")

# point -> (step killed, rank killed, checkpoint the restart must resume from). Rank 1 for the sync saves: rank 0's
# part in the commit is the same either way (it never commits while another rank is dead). In async saves rank 0 is
# also the committer on its background thread: it dies there at the manifest points.
POINTS = {
    "before_shards": (8, 1, "checkpoint_step00000004"),
    "between_shards": (12, 1, "checkpoint_step00000008"),
    "after_shards": (16, 1, "checkpoint_step00000012"),
    "before_manifest": (20, 1, "checkpoint_step00000016"),
    "after_manifest": (24, 1, "checkpoint_step00000024"),
}
ASYNC_RANK = {"before_manifest": 0, "after_manifest": 0}


def _drills(mode: str) -> str:
    items = []
    for point, (step, rank, _) in POINTS.items():
        rank = ASYNC_RANK.get(point, rank) if mode == "async" else rank
        items.append(f"{{rank: {rank}, step: {step}, point: {point}}}")
    return "[" + ", ".join(items) + "]"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_inside_a_save_resumes_from_the_newest_committed_checkpoint(ray_head, tmp_path, zero2_reference, mode):
    r, summary = run_job(tmp_path, [*COMMON, "--set", f"name=kp-{mode}", "--set", f"resilience.checkpoint_mode={mode}",
                                    "--set", f"chaos.kill_rank_in_checkpoint={_drills(mode)}"], ray_head.address)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    for point, (step, _, _) in POINTS.items():
        assert f"inside the checkpoint write of step {step} ({point})" in out, (point, out[-4000:])
    assert [m.group(1) for m in RESUMED.finditer(out)] == [expected for _, _, expected in POINTS.values()], out[-4000:]
    assert summary["restarts"] == len(POINTS) and summary["steps"] == STEPS
    loss = metric_history(tmp_path, summary["mlflow_run_id"], "train/loss")
    assert [s for s, _ in loss] == list(range(1, STEPS + 1))  # every step once, replayed ones included
    for step, value in loss:
        assert value == pytest.approx(zero2_reference[step], rel=1e-5), (mode, step, value, zero2_reference[step])
    if mode == "async":
        assert "checkpoints: resilience.checkpoint_mode async -> async" in out
        assert summary["checkpoint_write_s"] is not None and summary["checkpoint_bytes"] > 0
        for key in ("checkpoint/stall_s", "checkpoint/write_s", "checkpoint/bytes", "perf/checkpoint_stall_s"):
            assert metric_history(tmp_path, summary["mlflow_run_id"], key), key
