"""Kills at random points inside checkpoint writes, 2 workers under Ray Train (the drill of
scripts/checkpoint_kill_drill.py, 2 rounds here: seed 5 kills after a manifest on rank 1, so that step's checkpoint
must be the one resumed, then after the shards on rank 0, so it must not; the script runs 20;
tests/checkpoint/test_kill_points.py drills every point in both modes): every resume starts from the newest
committed checkpoint, never a torn one, and the loss curve equals an uninterrupted run's. The rounds join the
session's cluster (--address) instead of starting one each. (`make test-slow`.)"""

import json
import subprocess
import sys

import pytest

from _cluster import ROOT

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_kills_at_random_points_of_checkpoint_writes_resume_from_committed(ray_head, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "checkpoint_kill_drill.py"), "--kills", "2",
                        "--seed", "5", "--home", str(tmp_path), "--address", ray_head.address],
                       capture_output=True, text=True, timeout=1800)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rounds, final = lines[:-1], lines[-1]
    assert len(rounds) == 2 and all(x["killed"] and x["ok"] for x in rounds), rounds
    assert [x["point"] for x in rounds] == ["after_manifest", "after_shards"]  # seed 5: both outcomes of a kill
    assert final["all_resumes_verified"] and final["loss_curve_continues"] and final["final_round_rc"] == 0
