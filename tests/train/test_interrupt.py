"""SIGTERM (`ray job stop`, a scheduler's preemption) on `python jobs/train.py`, the in-process launcher: exit 130,
one line naming the step and the newest verified checkpoint, summary.json `interrupted`, the MLflow run KILLED (not
left RUNNING). The Ray Train side, SIGINT and the resubmission: tests/train/test_interrupt_drill.py (make
test-slow)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from _cluster import ROOT, seed_store


def test_sigterm_ends_the_run_killed_with_one_line_and_exit_130(tmp_path):
    seed_store(tmp_path)
    env = dict(os.environ, RAYSPEED_HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    args = ["--config", str(ROOT / "configs" / "tiny-cpu.yaml"), "--launcher", "local", "--set", "name=term",
            "--set", "train.max_steps=100000", "--set", "resilience.checkpoint_every_steps=2",
            "--set", "train.eval_every_steps=0"]
    first = tmp_path / "runs" / "term" / "checkpoint_step00000002" / "manifest.json"
    p = subprocess.Popen([sys.executable, str(ROOT / "jobs" / "train.py"), *args], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not first.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 130, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    (line,) = [x for x in out.splitlines() if "interrupted (SIGTERM) after step" in x]
    assert "newest verified checkpoint checkpoint_step" in line and "run the same command to resume" in line
    summary = json.loads((tmp_path / "runs" / "term" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM" and summary["steps"] >= 2
    assert summary["resume_from"] in line
    from mlflow.tracking import MlflowClient

    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(summary["mlflow_run_id"])
    assert run.info.status == "KILLED" and run.data.tags["rayspeed.status"] == "interrupted"
