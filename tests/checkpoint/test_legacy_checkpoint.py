"""A checkpoint written before the model wing moved (commit 1b290bf, the last before issue 56's changes) still
resumes, and the run ends where the old code's uninterrupted run ended: same tensor names, same pipeline layer
files, same function.

tests/fixtures/checkpoints/legacy-*/ hold each job's step-4 checkpoint of a 6-step run, made at 1b290bf by

    python jobs/train.py --config configs/tiny-cpu.yaml --launcher local --set name=legacy-dp2 \\
        --set train.max_steps=6 --set resilience.checkpoint_every_steps=4 <COMMON>           # one worker, ZeRO-2
    run_inprocess(home, "configs/tiny-cpu.yaml", [name=legacy-pp2, <the same>, parallel.pp=2,
        parallel.zero_stage=1, parallel.dp=1, parallel.tp=1], workers=2)                       # two stages

with COMMON = tracking.loss_landscape=false health.preflight=false train.eval_every_steps=0 train.warmup_steps=2.
That code's own 6-step runs ended at the final losses below; a resume that read the old tensors into the wrong
places, or a model that computes another function, ends elsewhere.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from _cluster import metric_history, run_job

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "checkpoints"
COMMON = ["train.max_steps=6", "resilience.checkpoint_every_steps=4", "tracking.loss_landscape=false",
          "health.preflight=false", "train.eval_every_steps=0", "train.warmup_steps=2"]
# The old code's uninterrupted 6-step runs (their summary.json's final_loss).
OLD_FINAL_LOSS = {"legacy-dp2": 4.350934028625488, "legacy-pp2": 4.3509345054626465}


def _home_with(tmp_path: Path, fixture: str, job: str) -> Path:
    shutil.copytree(FIXTURES / fixture / "checkpoint_step00000004", tmp_path / "runs" / job / "checkpoint_step00000004")
    return tmp_path


def test_a_checkpoint_from_before_the_model_wing_resumes_on_one_worker(tmp_path):
    home = _home_with(tmp_path, "legacy-dp1", "legacy-dp2")
    sets = [a for s in ["name=legacy-dp2", *COMMON] for a in ("--set", s)]
    r, s = run_job(home, ["--config", "configs/tiny-cpu.yaml", "--launcher", "local", *sets], None)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from checkpoint_step00000004 at step 4" in r.stderr
    assert s["steps"] == 6
    assert s["final_loss"] == pytest.approx(OLD_FINAL_LOSS["legacy-dp2"], rel=1e-5, abs=1e-5)


def test_a_pipelined_checkpoint_from_before_the_model_wing_resumes(tmp_path):
    from _inprocess import run_inprocess

    home = _home_with(tmp_path, "legacy-pp2", "legacy-pp2")
    sets = ["name=legacy-pp2", *COMMON, "parallel.pp=2", "parallel.zero_stage=1", "parallel.dp=1", "parallel.tp=1",
            "tracking.log_every_steps=1"]
    s = run_inprocess(home, str(ROOT / "configs" / "tiny-cpu.yaml"), sets, workers=2, timeout_s=300)
    assert s["steps"] == 6 and s["layout"]["pp"] == 2
    # The steps it trained are the two after the checkpoint (a fresh run would log all six, to the same end).
    assert [step for step, _ in metric_history(home, s["mlflow_run_id"], "train/loss")] == [5, 6]
    assert s["final_loss"] == pytest.approx(OLD_FINAL_LOSS["legacy-pp2"], rel=1e-5, abs=1e-5)
