"""eval.harness without a job: lm-eval's metric names become MLflow keys (no commas; the filter kept when it is not
`none`; standard errors left in the results JSON), lm-eval's own higher_is_better is read for a key, the section's
bad values are one message each naming the key, an unknown task stops the launch naming it, and the evaluation
process's environment carries no process-group variables of the training worker that starts it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayspeed.benchmarks.harness import higher_is_better, metric_key, metrics_of
from rayspeed.config.load import load
from rayspeed.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
RESULTS = {"results": {"arith": {"alias": "arith", "acc,none": 0.5, "acc_stderr,none": "N/A", "acc_norm,none": 0.25,
                                 "sample_len": 8},
                       "gsm8k": {"exact_match,strict-match": 0.125, "exact_match,flexible-extract": 0.25,
                                 "exact_match_stderr,strict-match": 0.01}},
           "higher_is_better": {"arith": {"acc": True, "acc_norm": True}, "gsm8k": {"exact_match": True},
                                "ppl": {"perplexity": False}}}


def test_lm_eval_scores_become_mlflow_keys():
    assert metrics_of(RESULTS) == {"eval/arith/acc": 0.5, "eval/arith/acc_norm": 0.25,
                                   "eval/gsm8k/exact_match_strict-match": 0.125,
                                   "eval/gsm8k/exact_match_flexible-extract": 0.25}
    assert metric_key("arith", "acc_stderr,none") is None and metric_key("a,b", "acc,none") == "eval/a_b/acc"
    ppl = {"results": {"ppl": {"perplexity,none": 12.0}}, "higher_is_better": {"ppl": {"perplexity": False}}}
    assert higher_is_better(ppl, "ppl", "perplexity") is False
    assert higher_is_better(RESULTS, "gsm8k", "exact_match_strict-match") is True


@pytest.mark.parametrize("sets, message", [
    (["eval.harness.limit=0"], "eval.harness.limit: must be >= 1"),
    (["eval.harness.include_path=/no/such/folder"], "eval.harness.include_path: /no/such/folder is not a folder"),
    (["resilience.checkpoint_every_steps=0"], "eval.harness.every_checkpoints: the job saves no checkpoints"),
    (["eval.harness.resources={GPU: -1}"], "eval.harness.resources: ['GPU'] must be numbers >= 0"),
])
def test_bad_harness_values_are_named(sets, message):
    with pytest.raises(ConfigError) as e:
        load(TINY, ["eval.harness.tasks=[arith]", *sets])
    assert message in str(e.value), str(e.value)


def test_an_unknown_task_stops_the_launch_naming_it(tmp_path):
    from _facts_task import write_task
    from rayspeed.train.launch_checks import harness_problems

    tasks = write_task(tmp_path)
    ok = load(TINY, ["eval.harness.tasks=[facts]", f"eval.harness.include_path={tasks}"])
    assert harness_problems(ok) == []
    bad = load(TINY, ["eval.harness.tasks=[facts, no_such_task_anywhere]", f"eval.harness.include_path={tasks}"])
    (problem,) = harness_problems(bad)
    assert "eval.harness.tasks: ['no_such_task_anywhere'] are neither task YAML files" in problem


def test_the_evaluation_process_leaves_the_process_group_behind(monkeypatch):
    from rayspeed.benchmarks.task import own_environment

    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2",
                 "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(k, v)
    env = own_environment({"HF_DATASETS_OFFLINE": "1"})
    assert not {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"} & set(env)
    assert env["HF_DATASETS_OFFLINE"] == "1" and env["PATH"]
