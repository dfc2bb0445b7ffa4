"""The planner's DPO terms (planner/dpo_terms.py) on the 1B planning example (8 x H100, seq 2048): a layout of b pairs
per micro-batch costs what the SFT layout of 2b sequences per micro-batch costs at twice the global batch (memory
component by component, time part by part, the same tokens per second); a resident reference adds its weights
(whole, in the working precision, whatever the ZeRO stage) and one forward per micro-batch (about a third of the
step's compute, no backward); an adapter's reference (its adapters off) adds the forward and no copy; the
precomputed reference adds nothing per step and reports its one-off pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayspeed.config.load import load
from rayspeed.planner import evaluate_layout

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "llama-1b-8xh100.yaml")
DPO = ["train.objective=dpo", "data.source=files", "data.path=x.jsonl", "data.tokenizer=tok"]
LAYOUT = dict(dp=8, tp=1, pp=1, zero_stage=2, micro_batch_size=2, grad_accum=8, activation_checkpointing="none")


def _plan(sets, **layout):
    return evaluate_layout(load(CONFIG, sets), {**LAYOUT, **layout}, 8)


def test_a_pair_costs_two_sequences():
    dpo = _plan([*DPO, "train.global_batch_size=128"])
    sft = _plan(["train.global_batch_size=256"], micro_batch_size=4)
    assert dpo["micro_batch_size"] == 2 and dpo["fits"]
    assert dpo["memory_breakdown_gib"] == sft["memory_breakdown_gib"]
    for part, seconds in sft["time_breakdown_s"].items():
        assert dpo["time_breakdown_s"][part] == pytest.approx(seconds, rel=1e-9), part
    assert dpo["tokens_per_s_per_gpu"] == pytest.approx(sft["tokens_per_s_per_gpu"], rel=1e-6)
    assert dpo["dpo_reference_pass_s_per_1000_pairs"] > 0 and "dpo_reference_pass_s_per_1000_pairs" not in sft
    assert "dpo_reference_forward_s" not in dpo["time_breakdown_s"]


def test_a_resident_reference_costs_its_weights_and_a_forward():
    pre = _plan([*DPO, "train.global_batch_size=128"])
    res = _plan([*DPO, "train.global_batch_size=128", "train.dpo.reference=resident"])
    gib = res["memory_breakdown_gib"]
    assert gib["dpo_reference_weights"] == pytest.approx(pre["memory_breakdown_gib"]["weights"], rel=1e-3)
    forward = res["time_breakdown_s"]["dpo_reference_forward_s"]
    assert 0.25 < forward / pre["time_breakdown_s"]["compute_s"] < 0.4  # forward of fwd + 2x backward
    assert res["step_time_s"] == pytest.approx(pre["step_time_s"] + forward, rel=0.02)

    adapter = ["model.adapter.type=lora", "train.dpo.reference=resident"]
    lora = _plan([*DPO, "train.global_batch_size=128", *adapter])
    assert "dpo_reference_weights" not in lora["memory_breakdown_gib"]
    assert lora["time_breakdown_s"]["dpo_reference_forward_s"] > 0
