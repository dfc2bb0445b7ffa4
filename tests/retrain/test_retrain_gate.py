"""rayspeed retrain --gate: promotion on benchmark scores measured now, the same way, on the champion and the
challenger (the job's eval.harness settings: a local lm-eval task the test writes). The cycle's training job is the
stub of test_retrain_promotion (it registers a prepared model); the two models are the example chat model and a
perturbed copy, the better-scoring one the champion. The worse challenger is rejected naming the gate and both
scores; the gate's arithmetic (direction from lm-eval, min_delta, a missing score) and bad --gate values are
checked without evaluating anything."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import _retrain_stub
from _facts_task import write_task
from _retrain_stub import REG, client, job_file, register_champion, stub_command

home = _retrain_stub.home  # the fixture


def _perturbed(source: str, out: Path, seed: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(out)
    for f in Path(source).iterdir():  # the tokenizer, its template
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return str(out)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_challenger_whose_score_dropped_is_rejected_naming_the_gate(home, examples_home):
    from rayspeed.benchmarks.harness import evaluate, metrics_of
    from rayspeed.retrain.cycle import run_cycle

    tasks = write_task(home)
    settings = {"tasks": ["facts"], "include_path": str(tasks), "limit": None, "num_fewshot": None,
                "chat_template": "auto", "batch_size": 8}
    candidates = [examples_home[1]["model"]]
    scores = [metrics_of(evaluate(candidates[0], settings))["eval/facts/acc"]]
    for seed in range(3):  # a second model that scores otherwise
        candidates.append(_perturbed(candidates[0], home / f"perturbed-{seed}", seed))
        scores.append(metrics_of(evaluate(candidates[-1], settings))["eval/facts/acc"])
        if scores[-1] != scores[0]:
            break
    assert scores[-1] != scores[0], scores
    pair = [(candidates[0], scores[0]), (candidates[-1], scores[-1])]
    (best, best_score), (worse, worse_score) = sorted(pair, key=lambda c: -c[1])
    cfg = job_file(home)
    with open(cfg, "a") as f:
        f.write(f"eval: {{harness: {{tasks: [facts], include_path: {tasks}}}}}\n"
                "resilience: {checkpoint_every_steps: 2}\n")
    register_champion(home, best, val=5.0)
    r = run_cycle(cfg, launcher="local", job_cmd=stub_command(home), gates=["facts/acc"], cold=True,
                  env={"STUB_MODEL_DIR": worse, "STUB_VAL_LOSS": "0.01"})
    assert (r.outcome, r.exit_code, r.version, r.champion_after) == ("rejected", 4, "2", "1"), r.reason
    assert (f"gate facts/acc: version 2 {worse_score:.6g} vs champion version 1 {best_score:.6g} (higher is better; "
            f"needs >= {best_score:.6g})") in r.reason
    tags = client(home).get_model_version(REG, "2").tags
    assert '"eval/facts/acc"' in tags["rayspeed.retrain.gate_scores.champion"]


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
