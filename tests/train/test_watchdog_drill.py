"""health.watchdog through a job's worker path (tests/_inprocess.py, one gloo process, ZeRO-0 fp32: the optimizer
path where DeepSpeed itself drops no non-finite step): its loss is NaN at step 3 (chaos.nan_loss_at_step).
`off` lets the update through and every later loss is NaN (the drill bites); `skip` withholds it: the run goes on
from the same weights, tagged; `rollback` restores the step-2 checkpoint and goes on. The engine-level proof over
every optimizer path (ZeRO 1-3 and bf16 drop a non-finite step themselves) is tests/train/test_step_guard.py."""

import math

import pytest

from _cluster import ROOT, metric_history
from _inprocess import run_inprocess

TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
STEPS = 6
BAD = 3


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("watchdog")


def _run(home, policy, *extra):
    sets = [f"name=wd-{policy}", f"train.max_steps={STEPS}", "tracking.log_every_steps=1", "train.eval_every_steps=0",
            "train.warmup_steps=1", "cluster.num_workers=1", "parallel.zero_stage=0",
            "tracking.charts_every_checkpoints=0", f"health.watchdog={policy}",
            f"chaos.nan_loss_at_step={{rank: 0, step: {BAD}}}", *extra]
    summary = run_inprocess(home, TINY, sets, workers=1)
    assert summary["status"] == "finished", summary
    return summary, dict(metric_history(home, summary["mlflow_run_id"], "train/loss"))


def _tags(home, run_id):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{home / 'mlflow.db'}").get_run(run_id).data.tags


def test_off_lets_the_nan_update_through(home):
    _, loss = _run(home, "off", "resilience.checkpoint_every_steps=0")
    assert math.isnan(loss[BAD])
    assert all(math.isnan(loss[s]) for s in range(BAD + 1, STEPS + 1)), loss


def test_skip_withholds_the_update(home):
    summary, loss = _run(home, "skip", "resilience.checkpoint_every_steps=0")
    assert math.isnan(loss[BAD])
    assert all(math.isfinite(loss[s]) for s in range(BAD + 1, STEPS + 1)), loss
    assert math.isfinite(summary["final_loss"])
    tag = _tags(home, summary["mlflow_run_id"]).get(f"rayspeed.watchdog.step{BAD}", "")
    assert tag.startswith("skipped: loss is nan"), tag


def test_rollback_restores_the_last_checkpoint(home):
    summary, loss = _run(home, "rollback", "resilience.checkpoint_every_steps=2")
    assert all(math.isfinite(loss[s]) for s in range(BAD + 1, STEPS + 1)), loss
    tag = _tags(home, summary["mlflow_run_id"]).get(f"rayspeed.watchdog.step{BAD}", "")
    assert tag.startswith("rollback to ") and "loss is nan" in tag, tag
