"""A step that runs out of memory re-plans the job and goes on (issue: no job dies of OOM): Ray Train, DeepSpeed,
MLflow, the real entry point; the out-of-memory error is the drill's (chaos.oom_at_step), raised as CUDA raises it."""

import pytest

from _cluster import ROOT, metric_history, run_job

pytestmark = pytest.mark.ray
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
COMMON = ["--config", TINY, "--set", "train.max_steps=6", "--set", "resilience.checkpoint_every_steps=2",
          "--set", "tracking.log_every_steps=1", "--set", "train.eval_every_steps=0",
          "--set", "tracking.loss_landscape=false", "--set", "tracking.charts_every_checkpoints=0"]


def test_an_out_of_memory_step_re_plans_onto_another_layout_and_the_job_finishes(ray_head, tmp_path):
    r, summary = run_job(tmp_path, [*COMMON, "--set", "name=oom-replan",
                                    "--set", "chaos.oom_at_step={rank: 0, step: 3}"], ray_head.address)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert summary["status"] == "finished" and summary["steps"] == 6 and summary["restarts"] == 1
    # The planner's layout for tiny-cpu on 2 workers is micro-batch 8 x 1; the drill refuses it.
    line = next(ln for ln in out.splitlines() if "re-planned after running out of memory" in ln)
    assert "(1 of resilience.oom_replans 2): dp 2 tp 1 pp 1 ZeRO-2 micro-batch 8 x 1 (out of memory at step 3" in line
    lay = summary["layout"]
    assert (lay["micro_batch_size"], lay["grad_accum"]) != (8, 1) and lay["micro_batch_size"] * lay["grad_accum"] == 8
    assert (f"now dp 2 tp 1 pp 1 ZeRO-2 micro-batch {lay['micro_batch_size']} x {lay['grad_accum']}") in line
    assert "kept as the job fixes them: zero_stage" in line  # tiny-cpu fixes parallel.zero_stage
    # One MLflow run: every step once, resumed from the step-2 checkpoint; the re-plan counted.
    run_id = summary["mlflow_run_id"]
    assert [s for s, _ in metric_history(tmp_path, run_id, "train/loss")] == [1, 2, 3, 4, 5, 6]
    assert metric_history(tmp_path, run_id, "plan/oom_replans") == [(2, 1.0)]


@pytest.mark.slow  # three attempts: `make test-slow`
def test_out_of_memory_on_every_layout_ends_the_job_listing_the_layouts_tried(ray_head, tmp_path):
    r, summary = run_job(tmp_path, [*COMMON, "--set", "name=oom-give-up", "--set", "resilience.oom_replans=1",
                                    "--set", "chaos.oom_at_step={rank: 0, step: 3, attempts: all}"], ray_head.address)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-4000:]
    assert summary["status"] == "out_of_memory"
    reason = next(ln for ln in out.splitlines() if "out of memory on every layout tried" in ln)
    assert "2 layouts after 1 re-plans (resilience.oom_replans)" in reason
    assert reason.count("(out of memory at step 3 on rank 0;") == 2
    assert "micro-batch 8 x 1 (out of memory" in reason
    assert "Traceback" not in reason
    from mlflow.tracking import MlflowClient

    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(summary["mlflow_run_id"])
    assert run.data.tags["rayspeed.status"] == "out_of_memory" and run.info.status == "FAILED"
    assert run.data.tags["rayspeed.oom_layouts"].count("out of memory at step 3") == 2
