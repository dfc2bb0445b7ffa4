"""Resubmitting a job name resumes its checkpoint only for the same run; --resume-anyway and --fresh say otherwise.
Real runs of jobs/train.py in-process (--launcher local), a real MLflow store."""

import json

import pytest

from _cluster import run_job
from rayspeed.config.load import parse
from rayspeed.train.resume_guard import differences, run_identity

ARGS = ["--config", "configs/tiny-cpu.yaml", "--launcher", "local", "--set", "name=guard", "--set",
        "resilience.checkpoint_every_steps=2", "--set", "tracking.loss_landscape=false", "--set",
        "health.preflight=false", "--set", "train.eval_every_steps=0"]


def test_identity_names_what_changed_and_ignores_how_it_runs():
    a = parse({"train": {"max_steps": 4}})
    b = parse({"train": {"max_steps": 6}, "parallel": {"zero_stage": 1}, "cluster": {"num_workers": 1}})
    assert differences(run_identity(a), run_identity(b)) == ["train.max_steps: 4 -> 6"]
    # Where the same data is cached is not what the run computes (a shared HF cache for several nodes).
    c = parse({"train": {"max_steps": 4}, "data": {"cache_dir": "/shared/tok", "hf_cache_dir": "/shared/hf"}})
    assert differences(run_identity(a), run_identity(c)) == []


@pytest.mark.slow  # a heavier end-to-end drill: `make test-slow`
def test_resubmission_with_other_settings_is_refused_unless_said(tmp_path):
    from rayspeed.tracking.client import mlflow_client

    r, s = run_job(tmp_path, [*ARGS, "--set", "train.max_steps=4"], None)
    assert r.returncode == 0 and s["steps"] == 4, r.stderr[-2000:]
    first_run = s["mlflow_run_id"]

    r, s = run_job(tmp_path, [*ARGS, "--set", "train.max_steps=6", "--set", "model.rope_theta=500000"], None)
    assert r.returncode == 2 and s is None
    err = r.stderr.strip().splitlines()[-1]
    assert "train.max_steps: 4 -> 6" in err and "model.rope_theta" in err, err
    assert "--resume-anyway" in err and "--fresh" in err and "Traceback" not in r.stderr

    r, s = run_job(tmp_path, [*ARGS, "--set", "train.max_steps=6", "--resume-anyway"], None)
    assert r.returncode == 0 and s["steps"] == 6, r.stderr[-2000:]
    assert "resumed from checkpoint_step00000004 at step 4" in r.stderr
    assert s["mlflow_run_id"] == first_run  # the same run, continued

    r, s = run_job(tmp_path, [*ARGS, "--set", "train.max_steps=2", "--fresh"], None)
    assert r.returncode == 0 and s["steps"] == 2, r.stderr[-2000:]
    assert "resumed from" not in r.stderr and "--fresh: moved the previous run's files" in r.stderr
    assert s["mlflow_run_id"] != first_run
    old = mlflow_client(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(first_run)
    assert old.data.tags["rayspeed.job"].startswith("guard@superseded-")
    assert any(p.name.startswith("guard.superseded-") for p in (tmp_path / "runs").iterdir())
    summary = json.loads((tmp_path / "runs" / "guard" / "summary.json").read_text())
    assert summary["steps"] == 2


def test_resubmitting_a_finished_job_reports_its_losses(tmp_path):
    """The same command again after the job finished resumes its last checkpoint, at max_steps: no step runs, and the
    summary says the losses the job ended with (it said NaN when the checkpoint did not carry them)."""
    args = [*ARGS, "--set", "train.max_steps=2", "--set", "train.eval_every_steps=2"]
    r, first = run_job(tmp_path, args, None)
    assert r.returncode == 0 and first["steps"] == 2, r.stderr[-2000:]
    r, again = run_job(tmp_path, args, None)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from checkpoint_step00000002 at step 2" in r.stderr
    assert again["final_loss"] == first["final_loss"] and again["val_loss"] == first["val_loss"]
