"""rayspeed retrain --gate: promotion on benchmark scores measured now, the same way, on the champion and the
challenger (the job's eval.harness settings: a local lm-eval task the test writes, tests/_facts_task.py). Three real
cycles (--launcher local, a real MLflow store in tmp_path) of a chat fine-tune of the example chat model on its
facts: the first starts from the pretrained weights and is promoted (no champion yet); the second, trained longer,
answers more of the task's questions and the gate promotes it; the third, at a destructive learning rate, answers
fewer and the gate rejects it naming both scores. A gate on a metric the task does not report is bad input before
anything trains; the gate's arithmetic (direction from lm-eval, min_delta, a missing score) is checked without
evaluating anything."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from test_retrain import _job as _byte_job
from test_retrain import home  # noqa: F401  (the fixture)

from _facts_task import write_task

REG = "rayspeed-rtg"
ROOT = Path(__file__).resolve().parents[2]


def _chat_facts_task(where: Path) -> Path:
    """tests/_facts_task.py's task over the example chat model's own facts (scripts/make_tiny_chat_model.py), so that
    training on its chats raises the score: the right answer and two other facts' answers, never first (a model
    whose weights are NaN picks the first choice: it scores 0)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_chat_model", ROOT / "scripts" / "make_tiny_chat_model.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    facts = script.FACTS
    tasks = write_task(where)
    with open(where / "facts.jsonl", "w") as f:
        for i, (question, answer) in enumerate(facts):
            wrong = [facts[(i + 1) % len(facts)][1], facts[(i + 7) % len(facts)][1]]
            k = 1 + i % 2
            f.write(json.dumps({"question": question, "choices": wrong[:k] + [answer] + wrong[k:], "answer": k}) + "\n")
    return tasks


def _chat_job(where: Path, made: dict, tasks: Path) -> str:
    cfg = where / "job.yaml"
    cfg.write_text(f"""
name: rtg
model: {{pretrained: "{made['model']}", init: pretrained, seq_len: 64}}
data: {{source: files, path: "{made['chats']}/*.jsonl", format: chat, tokenizer: model, document_masking: true,
       val_fraction: 0.1}}
train: {{global_batch_size: 8, max_steps: 2, lr: 1.0e-5, min_lr: 1.0e-5, warmup_steps: 0, weight_decay: 0.0,
        precision: fp32, eval_every_steps: 0, eval_batches: 1}}
cluster: {{num_workers: 1}}
resilience: {{checkpoint_every_steps: 0}}
eval: {{harness: {{tasks: [facts], include_path: "{tasks}", every_checkpoints: 0}}}}
tracking: {{log_every_steps: 10, system_metrics: false, loss_landscape: false, charts_every_checkpoints: 0}}
health: {{preflight: false}}
""")
    return str(cfg)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_gate_promotes_a_better_challenger_and_rejects_a_worse_one(home, examples_home, caplog):  # noqa: F811
    from mlflow.tracking import MlflowClient

    from rayspeed.retrain.cycle import run_cycle

    made = examples_home[1]
    cfg = _chat_job(home, made, _chat_facts_task(home))
    c = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    caplog.set_level(logging.INFO, logger="rayspeed.retrain")

    r1 = run_cycle(cfg, launcher="local", gates=["facts/acc"])
    assert (r1.outcome, r1.version, r1.champion_after) == ("promoted", "1", "1"), r1.reason
    start = next(m for m in caplog.messages if m.startswith(f"cycle {r1.job}: "))
    assert start == f"cycle {r1.job}: from the pretrained weights of {made['model']} (model.pretrained)", start
    assert c.get_model_version(REG, "1").tags["rayspeed.retrain.warm_start_from"] == f"model.pretrained {made['model']}"

    r2 = run_cycle(cfg, ["train.max_steps=150", "train.lr=3.0e-3", "train.min_lr=3.0e-4"], force=True,
                   launcher="local", gates=["facts/acc"])
    assert (r2.outcome, r2.exit_code, r2.version, r2.champion_after) == ("promoted", 0, "2", "2"), r2.reason
    tags = c.get_model_version(REG, "2").tags
    scores = {v: json.loads(tags[f"rayspeed.retrain.gate_scores.{who}"])["eval/facts/acc"]
              for v, who in (("1", "champion"), ("2", "challenger"))}
    assert r2.warm_start_from == f"models:/{REG}/1" and scores["2"] > scores["1"], scores
    assert f"gate facts/acc: version 2 {scores['2']:.6g} vs champion version 1 {scores['1']:.6g}" in r2.reason

    r3 = run_cycle(cfg, ["train.max_steps=4", "train.lr=3.0", "train.min_lr=3.0"], force=True, launcher="local",
                   gates=["facts/acc"])
    assert (r3.outcome, r3.exit_code, r3.version, r3.champion_after) == ("rejected", 4, "3", "2"), r3.reason
    worse = json.loads(c.get_model_version(REG, "3").tags["rayspeed.retrain.gate_scores.challenger"])["eval/facts/acc"]
    assert worse < scores["2"]
    assert (f"gate facts/acc: version 3 {worse:.6g} vs champion version 2 {scores['2']:.6g} (higher is better; "
            f"needs >= {scores['2']:.6g})") in r3.reason
    assert str(c.get_model_version_by_alias(REG, "champion").version) == "2"


def test_a_gate_on_a_metric_the_task_does_not_report_stops_before_training(home, capfd):  # noqa: F811
    from rayspeed.cli import main as cli

    cfg = _byte_job(home)
    tasks = write_task(home)
    with open(cfg, "a") as f:
        f.write(f'eval: {{harness: {{tasks: [facts], include_path: "{tasks}", every_checkpoints: 0}}}}\n')
    before = sorted(p.relative_to(home) for p in home.rglob("*"))
    capfd.readouterr()
    assert cli(["retrain", "--config", str(cfg), "--gate", "facts/acc_norm", "--launcher", "local"]) == 2
    out, err = capfd.readouterr()
    assert err.strip().splitlines() == [
        "retrain: bad_input (exit 2): --gate facts/acc_norm: task 'facts' reports no metric 'acc_norm'; its metrics: "
        "acc (use one of them, e.g. --gate facts/acc)"], err
    assert json.loads(out.strip().splitlines()[-1])["exit_code"] == 2
    assert sorted(p.relative_to(home) for p in home.rglob("*")) == before  # nothing written


def test_metric_names_come_from_the_task_config(tmp_path):
    """metric_list x filter_list as lm-eval labels the scores (the filter kept after an underscore unless `none`),
    lm-eval's defaults for the output type without a metric_list; None where the config alone does not say."""
    from rayspeed.benchmarks.harness import metric_labels

    tasks = write_task(tmp_path)
    (tasks / "gen.yaml").write_text(
        "task: gen\ndataset_path: json\noutput_type: generate_until\ndoc_to_text: q\ndoc_to_target: a\n"
        "metric_list:\n  - metric: exact_match\nfilter_list:\n  - name: strict-match\n    filter:\n"
        "      - function: take_first\n  - name: none\n    filter:\n      - function: take_first\n")
    (tasks / "mc.yaml").write_text("task: mc\ndataset_path: json\noutput_type: multiple_choice\ndoc_to_text: q\n"
                                   "doc_to_choice: c\ndoc_to_target: 0\n")
    (tasks / "custom.yaml").write_text("task: custom\ndataset_path: json\nprocess_results: !function utils.score\n"
                                       "doc_to_text: q\ndoc_to_target: a\n")
    settings = {"tasks": ["facts", "gen", "mc", "custom"], "include_path": str(tasks)}
    assert metric_labels("facts", settings) == ["acc"]
    assert metric_labels("gen", settings) == ["exact_match", "exact_match_strict-match"]
    assert metric_labels("mc", settings) == ["acc", "acc_norm"]
    assert metric_labels("custom", settings) is None


def test_the_gate_arithmetic():
    from types import SimpleNamespace

    from rayspeed.retrain.gates import judge, parse_gates

    cfg = SimpleNamespace(eval=SimpleNamespace(harness=SimpleNamespace(tasks=["arith", "ppl"])))
    up = lambda v: {"results": {"arith": {"acc,none": v}}, "higher_is_better": {"arith": {"acc": True}}}  # noqa: E731
    down = lambda v: {"results": {"ppl": {"word_perplexity,none": v}},  # noqa: E731
                      "higher_is_better": {"ppl": {"word_perplexity": False}}}
    (g,) = parse_gates(["arith/acc:0.05"], cfg)
    assert judge([g], up(0.60), up(0.55), "3", "2")[0] and not judge([g], up(0.59), up(0.55), "3", "2")[0]
    (tolerant,) = parse_gates(["arith/acc:-0.1"], cfg)
    assert judge([tolerant], up(0.50), up(0.55), "3", "2")[0]
    (p,) = parse_gates(["ppl/word_perplexity:1"], cfg)
    ok, why = judge([p], down(10.0), down(12.0), "3", "2")
    assert ok and "lower is better; needs <= 11" in why
    assert not judge([p], down(11.5), down(12.0), "3", "2")[0]
    ok, why = judge([g], {"results": {"arith": {}}}, up(0.5), "3", "2")
    assert not ok and "gate arith/acc:0.05: the challenger's evaluation has no eval/arith/acc" in why
    for bad, message in (("arith", "expected <task>/<metric>[:min_delta]"), ("arith/acc:x", "is not a number"),
                         ("mmlu/acc", "task 'mmlu' is not in the job's eval.harness.tasks")):
        with pytest.raises(ValueError) as e:
            parse_gates([bad], cfg)
        assert message in str(e.value)
