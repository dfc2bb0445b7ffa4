"""Ctrl-C, checkpoint rotation and resubmission with real Ray Train runs (`make test-slow`): a job keeping 2
checkpoints is interrupted by SIGINT after its fourth save (its oldest already deleted), exits 130 with one line,
its MLflow run KILLED and summary.json `interrupted`, naming the checkpoint to resume (said again if a save in flight
committed after the line); the same command then resumes that newest verified checkpoint
and every loss it logs, replayed steps included, equals the session's uninterrupted run (conftest's
zero2_reference) bit for bit, in the same MLflow run, FINISHED. Sync and async checkpoints. A rank hangs at step 12
(chaos, once per job) and the signal is sent once it has, so it always lands mid-run whatever the machine's speed,
and the resubmission never meets the hang (it would wait out resilience.collective_timeout_s)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from _cluster import ROOT, ZERO2_REFERENCE, metric_history, run_job, seed_store

pytestmark = [pytest.mark.ray, pytest.mark.slow]
STEPS = 30
RESUMED = re.compile(r"resumed from (checkpoint_step\d+) at step (\d+)")
INTERRUPTED = re.compile(r"interrupted \(SIGINT\) after step (\d+); newest verified checkpoint (checkpoint_step\d+); "
                         r"run the same command to resume")
HANG = "chaos: rank 1 hangs at step 12"


def _args(mode: str) -> list[str]:
    return [*ZERO2_REFERENCE, "--set", f"name=ctrl-c-{mode}", "--set", "resilience.checkpoint_every_steps=2",
            "--set", "resilience.keep_checkpoints=2", "--set", f"resilience.checkpoint_mode={mode}",
            "--set", "chaos.hang_rank_at_step={rank: 1, step: 12}"]


def _interrupt_after_fourth_save(home, args, address) -> tuple[int, str]:
    seed_store(home)
    env = dict(os.environ, RAYSPEED_HOME=str(home), PYTHONUNBUFFERED="1", RAY_ADDRESS=address, RAY_AUTH_MODE="token")
    env.pop("MLFLOW_TRACKING_URI", None)
    name = next(a.split("=", 1)[1] for a in args if a.startswith("name="))
    fourth = home / "runs" / name / "checkpoint_step00000008" / "manifest.json"
    rotated = home / "runs" / name / "checkpoint_step00000004"  # deleted by retention after the fourth save
    log = home / "interrupted.log"  # read by its own handle: a seek on `out` would move the job's writes
    with open(log, "w+") as out:
        p = subprocess.Popen([sys.executable, str(ROOT / "jobs" / "train.py"), *args], env=env, stdout=out,
                             stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 300
        while not (fourth.exists() and not rotated.exists() and HANG in log.read_text()) and p.poll() is None \
                and time.time() < deadline:
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=120)
        out.seek(0)
        return rc, out.read()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_interrupted_after_rotations_the_same_command_continues_bit_exact(ray_head, zero2_reference, tmp_path, mode):
    args = _args(mode)
    rc, out = _interrupt_after_fourth_save(tmp_path, args, ray_head.address)
    assert rc == 130, out[-4000:]
    said = list(INTERRUPTED.finditer(out))  # a save in flight at the signal may commit after the first line:
    assert said, out[-4000:]  # then a second line names it, and the last word is the one that counts
    m = said[-1]
    exp = tmp_path / "runs" / f"ctrl-c-{mode}"
    summary = json.loads((exp / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["resume_from"] == m.group(2)
    assert int(m.group(1)) >= 8 and m.group(2) >= "checkpoint_step00000008"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = summary["mlflow_run_id"]
    assert client.get_run(run_id).info.status == "KILLED"

    r, done = run_job(tmp_path, args, ray_head.address)  # the same command
    assert r.returncode == 0 and done["status"] == "finished" and done["steps"] == STEPS, r.stderr[-4000:]
    resumed = RESUMED.findall(r.stderr)
    assert resumed and resumed[0][0] == m.group(2), r.stderr[-4000:]
    assert done["mlflow_run_id"] == run_id and client.get_run(run_id).info.status == "FINISHED"
    loss = metric_history(tmp_path, run_id, "train/loss")
    assert sorted({s for s, _ in loss}) == list(range(1, STEPS + 1))
    differing = [(s, v, zero2_reference[s]) for s, v in loss if v != zero2_reference[s]]
    assert not differing, (mode, differing[:5])
    if mode == "async":
        assert "checkpoint_mode async -> async" in out
        return
    # A resubmission that asks for more steps continues the finished run (the checkpoints rotated many times).
    r, more = run_job(tmp_path, [*args, "--resume-anyway", "--set", "train.max_steps=32"], ray_head.address)
    assert r.returncode == 0 and more["steps"] == 32 and more["mlflow_run_id"] == run_id, r.stderr[-4000:]
    assert RESUMED.findall(r.stderr)[0] == ("checkpoint_step00000030", "30")
    assert client.get_run(run_id).info.status == "FINISHED"
