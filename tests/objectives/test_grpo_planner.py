"""The planner's GRPO terms (planner/grpo_terms.py) on the 1B planning example (8 x H100, seq 2048, 256 completions
per step): each rank samples its 32 completions at once, so the key/value cache is 32 x 2048 positions x 22 layers x
2 x 4 kv heads x 64 x 2 bytes (bf16); sampling needs what exceeds training's transient peak (nothing with the
activations of an unchecked micro-batch of 4, the excess once full recomputation makes them small); its time is a
prefill plus max_new_tokens memory-bound decode steps (linear in max_new_tokens); beta > 0 adds a frozen copy of the
weights (none with an adapter) and a forward per micro-batch; `rayspeed plan` says what sampling costs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rayspeed.config.load import load
from rayspeed.planner import evaluate_layout

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "llama-1b-8xh100.yaml")
GRPO = ["train.objective=grpo", "data.source=files", "data.path=x.jsonl", "data.tokenizer=tok",
        "train.grpo.rewards=[my.rewards:exact]", "train.global_batch_size=256", "train.grpo.max_new_tokens=1024"]
LAYOUT = dict(dp=8, tp=1, pp=1, zero_stage=2, micro_batch_size=4, grad_accum=8, activation_checkpointing="none")
GIB = 2 ** 30


def _plan(sets=(), **layout):
    return evaluate_layout(load(CONFIG, [*GRPO, *sets]), {**LAYOUT, **layout}, 8)


def test_the_cache_and_the_sampling_time():
    p = _plan()
    assert p["grpo_rollout"]["completions_per_rank"] == 32
    assert p["grpo_rollout"]["kv_cache_gib"] == pytest.approx(32 * 2048 * 22 * 2 * 4 * 64 * 2 / GIB, rel=1e-3)
    assert p["memory_breakdown_gib"]["grpo_rollout"] == 0.0  # under an unchecked micro-batch's activations
    shorter = _plan(["train.grpo.max_new_tokens=512"])
    per_token = (p["time_breakdown_s"]["grpo_rollout_s"] - shorter["time_breakdown_s"]["grpo_rollout_s"]) / 512
    weights = p["memory_breakdown_gib"]["weights"] * GIB  # ZeRO-2 keeps every weight on each rank
    bandwidth = 3350e9 * 0.8  # H100 SXM HBM3 at the element-wise share (planner/hardware.py)
    assert per_token == pytest.approx((weights + p["grpo_rollout"]["kv_cache_gib"] * GIB / 2) / bandwidth, rel=0.02)
    assert p["step_time_s"] > shorter["step_time_s"]


def test_sampling_counts_where_it_exceeds_trainings_own_peak():
    p = _plan(activation_checkpointing="full")
    m = p["memory_breakdown_gib"]
    assert m["grpo_rollout"] > 0
    assert m["grpo_rollout"] + m["activations"] + m["logits_loss"] > p["grpo_rollout"]["kv_cache_gib"]


def test_a_kl_reference_costs_a_copy_unless_an_adapter_is_its_base():
    base, beta = _plan(), _plan(["train.grpo.beta=0.04"])
    assert beta["memory_breakdown_gib"]["grpo_reference_weights"] == pytest.approx(
        base["memory_breakdown_gib"]["weights"], rel=1e-6)
    assert beta["time_breakdown_s"]["grpo_reference_forward_s"] > 0
    lora = _plan(["train.grpo.beta=0.04", "model.adapter.type=lora", "model.adapter.rank=16"])
    assert "grpo_reference_weights" not in lora["memory_breakdown_gib"]
    assert "grpo_reference_forward_s" in lora["time_breakdown_s"]


def test_plan_says_what_sampling_costs(examples_home):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "platform"), "RAYSPEED_HOME": str(examples_home[0])}
    r = subprocess.run([sys.executable, "-m", "rayspeed", "plan", str(ROOT / "configs" / "tiny-grpo-cpu.yaml")],
                       capture_output=True, text=True, env=env, timeout=120, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "grpo: each rank samples its 32 completions at once between steps" in r.stdout, r.stdout
