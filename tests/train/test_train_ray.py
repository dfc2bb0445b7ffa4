"""End to end through the real entry point on a real local Ray cluster: Ray Train + DeepSpeed ZeRO-2 +
MLflow, killed mid-run and resumed from its verified checkpoint."""

import json

import pytest

from _cluster import ROOT, metric_history, run_job

pytestmark = pytest.mark.ray
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")


COMMON = ["--set", "train.max_steps=30", "--set", "parallel.zero_stage=2",
          "--set", "resilience.checkpoint_every_steps=5",
          "--set", "tracking.log_every_steps=1", "--set", "train.eval_every_steps=15"]


@pytest.mark.slow  # a heavier end-to-end drill: `make test-slow`
def test_zero2_kill_drill_matches_uninterrupted_run(ray_head, tmp_path, zero2_reference):
    """The issue's kill drill: rank 1 dies at step 12 of 30 with checkpoints every 5 steps; the job resumes
    from step 10 in the same MLflow run and logs the same losses as a run that was never killed (conftest's
    zero2_reference, which also validates never: validation every 15 steps changes no training loss)."""
    r, summary = run_job(tmp_path, ["--config", TINY, "--set", "name=kill-resume", *COMMON,
                                    "--set", "chaos.kill_rank_at_step={rank: 1, step: 12}"], ray_head.address)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert summary["status"] == "finished" and summary["steps"] == 30 and summary["restarts"] == 1
    assert summary["world_size"] == 2
    on_disk = json.loads((tmp_path / "runs" / "kill-resume" / "summary.json").read_text())
    assert on_disk["mlflow_run_id"] == summary["mlflow_run_id"]

    loss = metric_history(tmp_path, summary["mlflow_run_id"], "train/loss")
    ref = zero2_reference
    # Steps 1-11 ran, rank 1 died before step 12, the job resumed from step 10 and ran 11-30: the replayed
    # step 11 is logged once. Every logged value equals the uninterrupted run's (exact resume).
    assert [s for s, _ in loss] == list(range(1, 31))
    for s, v in loss:
        assert v == pytest.approx(ref[s], rel=1e-5), f"step {s}: {v} vs uninterrupted {ref[s]}"
    assert loss[-1][1] < loss[0][1] - 0.5  # it learns
    assert metric_history(tmp_path, summary["mlflow_run_id"], "resilience/restarts")[-1] == (11, 1.0)
    (rec_step, recovery), = metric_history(tmp_path, summary["mlflow_run_id"], "resilience/recovery_s")
    assert rec_step == 11 and recovery > 0 and summary["recovery_s"] == pytest.approx(recovery)
    assert metric_history(tmp_path, summary["mlflow_run_id"], "resilience/lost_steps") == [(11, 1.0)]
    print(f"\nkill drill: resilience/recovery_s = {recovery:.1f}")
    # Where the seconds went: the start from the command (step 1), the recovery from the failure (step 11).
    run_id = summary["mlflow_run_id"]
    phases = ("interpreter", "config", "plan", "checks", "ray", "data", "mlflow", "worker_start", "imports",
              "init_distributed", "groups_and_data", "engine", "resume", "preflight", "first_step")
    start = {k: metric_history(tmp_path, run_id, f"startup/{k}_s") for k in (*phases, "total")}
    assert all(h and h[0][0] == 1 and h[0][1] >= 0 for h in start.values()), start
    assert sum(start[k][0][1] for k in phases) == pytest.approx(start["total"][0][1], abs=1e-3)
    (rec_total,) = metric_history(tmp_path, run_id, "recovery/total_s")
    assert rec_total[0] == 11 and rec_total[1] == pytest.approx(recovery, abs=0.5)
    restart_phases = ("restart", *phases[phases.index("imports"):])
    assert sum(metric_history(tmp_path, run_id, f"recovery/{k}_s")[0][1] for k in restart_phases) == pytest.approx(
        rec_total[1], abs=1e-3)
    assert "start: " in r.stderr and "s from the command to the first step (interpreter " in r.stderr

    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = c.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "kill-resume"
    assert run.data.params["parallel.zero_stage"] == "2" and run.data.params["parallel.dp"] == "2"
    assert len(run.data.params) >= 20
    assert "rayspeed.restart.1" in run.data.tags
    import mlflow

    # Listing a run's "model" folder also lists its logged model, which MLflow looks up in the process-wide
    # store (conftest puts it back after the test).
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    arts = {a.path for d in ("config", "plan", "charts", "model") for a in c.list_artifacts(run.info.run_id, d)}
    assert {"config/resolved.yaml", "config/deepspeed.json", "plan/plan.json", "plan/explain.txt"} <= arts
    assert len([a for a in arts if a.startswith("charts/") and a.endswith(".png")]) == 5
    assert "model/weights.pt" in arts
    ds = json.loads(c.download_artifacts(run.info.run_id, "config/deepspeed.json", str(tmp_path / "dl")) and
                    (tmp_path / "dl" / "deepspeed.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2 and ds["train_batch_size"] == 16
    assert metric_history(tmp_path, summary["mlflow_run_id"], "comm/grad_sync_fraction")
    assert any(k.startswith("system/node0/rank1/") for k in run.data.metrics)
    mv = c.get_model_version("rayspeed-kill-resume", "1")
    assert mv.run_id == run.info.run_id
    # Only verified checkpoints remain, at least two of them.
    ckpts = sorted(p.name for p in (tmp_path / "runs" / "kill-resume").glob("checkpoint_step*"))
    assert ckpts == ["checkpoint_step00000025", "checkpoint_step00000030"]


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


@pytest.mark.slow  # a heavier end-to-end drill: `make test-slow`
def test_a_failure_before_the_first_checkpoint_counts_and_recovers(ray_head, tmp_path):
    """Rank 1 dies at step 3, before any checkpoint (every 10 steps): the restart trains from step 0 again. The
    restart is counted and its recovery measured from the controller's event (before, neither was, and the next
    recovery was measured from this failure), and the replayed steps 1-2 are logged once."""
    r, summary = run_job(tmp_path, ["--config", TINY, "--set", "name=early-kill", "--set", "train.max_steps=6",
                                    "--set", "resilience.checkpoint_every_steps=10", "--set",
                                    "tracking.log_every_steps=1", "--set", "train.eval_every_steps=0", "--set",
                                    "tracking.loss_landscape=false", "--set",
                                    "chaos.kill_rank_at_step={rank: 1, step: 3}"], ray_head.address)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert summary["restarts"] == 1 and summary["recovery_s"] and summary["recovery_s"] > 0
    run_id = summary["mlflow_run_id"]
    assert [s for s, _ in metric_history(tmp_path, run_id, "train/loss")] == list(range(1, 7))
    assert metric_history(tmp_path, run_id, "resilience/restarts")[-1][1] == 1.0
    (step, recovery), = metric_history(tmp_path, run_id, "resilience/recovery_s")
    assert step == 1 and recovery == pytest.approx(summary["recovery_s"])
    from rayspeed.train.resilience import pending_event

    assert pending_event(str(tmp_path / "runs" / "early-kill")) is None  # the incident is closed
