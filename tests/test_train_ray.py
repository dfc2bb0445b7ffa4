"""End to end through the real entry point on a real local Ray cluster: Ray Train + DeepSpeed ZeRO-2 +
MLflow, killed mid-run and resumed from its verified checkpoint."""

import json

import pytest

from _cluster import ROOT, metric_history, run_job

pytestmark = pytest.mark.ray
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")


def test_zero2_two_workers_killed_and_resumed(ray_head, tmp_path):
    r, summary = run_job(
        tmp_path,
        ["--config", TINY, "--set", "name=kill-resume", "--set", "train.max_steps=12",
         "--set", "parallel.zero_stage=2", "--set", "resilience.checkpoint_every_steps=5",
         "--set", "tracking.log_every_steps=1", "--set", "chaos.kill_rank_at_step={rank: 1, step: 7}"],
        ray_head.address,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert summary["status"] == "finished" and summary["steps"] == 12 and summary["restarts"] == 1
    assert summary["world_size"] == 2
    on_disk = json.loads((tmp_path / "runs" / "kill-resume" / "summary.json").read_text())
    assert on_disk["mlflow_run_id"] == summary["mlflow_run_id"]

    loss = metric_history(tmp_path, summary["mlflow_run_id"], "train/loss")
    steps = [s for s, _ in loss]
    # Steps 1-6 ran, rank 1 died before step 7, the job resumed from step 5 and ran 6-12 again:
    # step 6 is logged twice, and the resumed run computed exactly the same loss (exact resume).
    assert steps == [1, 2, 3, 4, 5, 6, 6, 7, 8, 9, 10, 11, 12]
    six = [v for s, v in loss if s == 6]
    assert six[0] == pytest.approx(six[1], rel=1e-6)
    assert loss[-1][1] < loss[0][1] - 0.5  # it learns
    assert metric_history(tmp_path, summary["mlflow_run_id"], "resilience/restarts")[-1] == (6, 1.0)
    (rec_step, recovery), = metric_history(tmp_path, summary["mlflow_run_id"], "resilience/recovery_s")
    assert rec_step == 6 and 0 < recovery < 300 and summary["recovery_s"] == pytest.approx(recovery)
    assert metric_history(tmp_path, summary["mlflow_run_id"], "resilience/lost_steps") == [(6, 1.0)]
    assert metric_history(tmp_path, summary["mlflow_run_id"], "val/loss")

    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = c.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "kill-resume"
    assert run.data.params["parallel.zero_stage"] == "2" and run.data.params["parallel.dp"] == "2"
    assert len(run.data.params) >= 20
    arts = {a.path for d in ("config", "plan") for a in c.list_artifacts(run.info.run_id, d)}
    assert {"config/resolved.yaml", "config/deepspeed.json", "plan/plan.json", "plan/explain.txt"} <= arts
    ds = json.loads(c.download_artifacts(run.info.run_id, "config/deepspeed.json", str(tmp_path / "dl")) and
                    (tmp_path / "dl" / "deepspeed.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2 and ds["train_batch_size"] == 16
    # Only verified checkpoints remain, at least two of them.
    ckpts = sorted(p.name for p in (tmp_path / "runs" / "kill-resume").glob("checkpoint_step*"))
    assert ckpts == ["checkpoint_step00000010", "checkpoint_step00000012"]


def test_failed_preflight_fails_fast_with_the_reason(ray_head, tmp_path):
    """An impossible bandwidth floor: the job stops before step 0, without burning its restarts."""
    r, summary = run_job(
        tmp_path,
        ["--config", TINY, "--set", "name=preflight-fail", "--set", "health.preflight_min_busbw_gbps=100000"],
        ray_head.address,
    )
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert summary["status"] == "preflight_failed" and summary["steps"] == 0
    assert "busbw" in summary["error"] and summary["restarts"] == 0
    from mlflow.tracking import MlflowClient

    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(summary["mlflow_run_id"])
    assert run.info.status == "FAILED" and run.data.tags["rayspeed.status"] == "preflight_failed"
