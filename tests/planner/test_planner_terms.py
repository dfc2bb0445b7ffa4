"""A feature's planner terms (rayspeed.planner.terms) reach the plan without an edit to memory.py or timing.py: a
registered memory term is one more component (churning terms widen the allocator's slack), a time term one more
part of the step in the kind the calibration scales; both are explained under their names, and gone once
unregistered."""

import pytest

from rayspeed.config.load import parse
from rayspeed.planner import evaluate_layout
from rayspeed.planner.hardware import GIB
from rayspeed.planner.terms import MemoryTerm, TimeTerm, register, unregister

JOB = {"name": "terms", "model": {"hidden_size": 2048, "num_layers": 16, "num_heads": 16, "vocab_size": 32000,
                                  "seq_len": 2048},
       "train": {"global_batch_size": 64}, "cluster": {"num_workers": 8, "use_gpu": True, "gpu": "h100-sxm-80gb"}}
LAYOUT = {"dp": 8, "tp": 1, "pp": 1, "zero_stage": 1, "micro_batch_size": 2}


@pytest.fixture
def terms():
    yield
    unregister("example_states")
    unregister("example_exchange_s")


def test_terms_add_to_memory_time_and_the_explanation(terms):
    cfg = parse(JOB)
    before = evaluate_layout(cfg, LAYOUT)
    register(MemoryTerm("example_states", applies=lambda ctx, lay: lay.dp > 1, bytes=lambda ctx, lay, st: GIB,
                        source="test"))
    register(TimeTerm("example_exchange_s", applies=lambda ctx, lay: True, seconds=lambda ctx, lay: 0.25,
                      kind="communication", source="test"))
    register(TimeTerm("example_exchange_s", applies=lambda ctx, lay: True, seconds=lambda ctx, lay: 0.5,
                      kind="communication", source="test"))  # registered again: replaced, not counted twice
    after = evaluate_layout(cfg, LAYOUT)
    assert after["memory_breakdown_gib"]["example_states"] == 1.0
    slack = after["memory_breakdown_gib"]["allocator_slack"] - before["memory_breakdown_gib"]["allocator_slack"]
    assert slack == pytest.approx(0.05, abs=1e-3)
    assert after["memory_gib_per_gpu"] == pytest.approx(before["memory_gib_per_gpu"] + 1.05, abs=2e-3)
    assert after["time_breakdown_s"]["example_exchange_s"] == 0.5
    assert after["step_time_s"] == pytest.approx(before["step_time_s"] + 0.5, abs=1e-5)
    from rayspeed.planner import plan_job

    text = plan_job(cfg, world_size=8).explain
    assert "example_states" in text and "example_exchange_s" in text
    unregister("example_states")
    unregister("example_exchange_s")
    assert evaluate_layout(cfg, LAYOUT) == before


def test_a_time_term_names_its_kind():
    with pytest.raises(ValueError, match="kind must be one of"):
        TimeTerm("x", applies=lambda ctx, lay: True, seconds=lambda ctx, lay: 0.0, source="test", kind="magic")
