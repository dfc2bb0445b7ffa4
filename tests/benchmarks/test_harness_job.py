"""eval.harness during an SFT job through the worker path (tests/_inprocess.py: two gloo workers; the evaluations
are background processes, as under --launcher local): the example chat model fine-tuned with a local lm-eval task
(a multiple-choice JSONL the test writes) logs eval/facts/acc at each committed checkpoint's step, its results
JSON as eval/step_N.json, and the first evaluation's score reaches MLflow while training goes on: before the
last step's loss is logged, with steps logged between its submission and its result (the job's own callback slows
the steps after the evaluated checkpoint, at most 2 s each, until the scores are in, and holds the step before the
last for them, so the order does not hang on this machine's speed; the scores it waits for are the ones rayspeed
keeps for a job's callbacks). The last score equals lm-eval's own simple_evaluate on that checkpoint, exported the
way users export one."""

from __future__ import annotations

import json
import time

import pytest

from _facts_task import write_task
from rayspeed.train.events import Callback

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


class SlowSteps(Callback):
    """Until the first evaluation's scores are in (rank 0's state.extra["eval.harness"]), up to 2 s per step after
    its checkpoint, and step 39 waits for them (up to 120 s): an evaluation takes 10 to 40 s here, so some steps end
    while it runs (at most 2 s each) and the last one cannot end before it, whatever this machine's speed."""

    def on_step_end(self, state):
        if not state.is_rank0 or state.step <= 20:
            return
        for _ in range(480 if state.step == 39 else 8):
            if 20 in state.extra.get("eval.harness", {}):
                return
            time.sleep(0.25)


def test_scores_at_each_checkpoint_arrive_while_training_goes_on(examples_home, tmp_path):
    import mlflow

    from _cluster import ROOT, metric_history
    from _inprocess import run_inprocess
    from rayspeed.compat import mlflow_process_store

    made = examples_home[1]
    tasks = write_task(tmp_path)
    sets = [f"model.pretrained={made['model']}", f"data.path={made['chats']}/*.jsonl", "name=sft-harness",
            "train.max_steps=40", "resilience.checkpoint_every_steps=10", "train.eval_every_steps=0",
            "eval.harness.tasks=[facts]", f"eval.harness.include_path={tasks}", "eval.harness.every_checkpoints=2",
            "train.callbacks=[test_harness_job:SlowSteps]", "tracking.log_every_steps=1"]
    summary = run_inprocess(tmp_path, str(ROOT / "configs" / "tiny-chat-finetune-cpu.yaml"), sets, workers=2,
                            timeout_s=600)
    assert summary["status"] == "finished", summary
    run_id = summary["mlflow_run_id"]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    scores = sorted(client.get_metric_history(run_id, "eval/facts/acc"), key=lambda m: m.step)
    assert [m.step for m in scores] == [20, 40] and all(0.0 <= m.value <= 1.0 for m in scores)

    # lm-eval's own simple_evaluate on the last checkpoint, exported as users export it, with the job's settings (the
    # whole task, zero-shot, the tokenizer's chat template: checked in the results JSON below): the score rayspeed
    # recorded is lm-eval's.
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from rayspeed.cli import main as cli

    exported = tmp_path / "exported"
    assert cli(["export", str(tmp_path / "runs" / "sft-harness" / "checkpoint_step00000040"), str(exported),
                "--format", "hf"]) == 0
    own = simple_evaluate(model="hf", model_args={"pretrained": str(exported), "dtype": "float32"}, tasks=["facts"],
                          device="cpu", batch_size=8, apply_chat_template=True, bootstrap_iters=0,
                          task_manager=TaskManager(include_path=str(tasks), include_defaults=False))
    assert own["n-samples"]["facts"]["effective"] == 4
    assert {k: v for k, v in own["results"]["facts"].items() if isinstance(v, float)} == {"acc,none": scores[-1].value}

    losses = {m.step: m.timestamp for m in client.get_metric_history(run_id, "train/loss")}
    first = scores[0].timestamp
    assert first < losses[40], "the first evaluation's score came after training ended"
    assert sum(1 for s, ts in losses.items() if 20 < s < 40 and ts < first) >= 2  # steps went on meanwhile
    with mlflow_process_store(f"sqlite:///{tmp_path / 'mlflow.db'}"):
        names = sorted(a.path for a in client.list_artifacts(run_id, "eval"))
        record = json.loads(mlflow.artifacts.load_text(f"runs:/{run_id}/eval/step_0000020.json"))
    assert names == ["eval/step_0000020.json", "eval/step_0000040.json"], names
    assert record["results"]["facts"]["acc,none"] == scores[0].value and record["n-samples"]["facts"]["effective"] == 4
    assert record["chat_template"] is True  # the example's tokenizer has one (eval.harness.chat_template auto)
    assert metric_history(tmp_path, run_id, "train/loss")[-1][0] == 40

