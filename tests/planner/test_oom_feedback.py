"""What a step that ran out of memory teaches the planner (rayspeed.planner.oom_feedback, torch-free): the layout
is refused, its kind gets the measured shortfall, nothing is ever lowered; the attempt's line names both layouts."""

from pathlib import Path

from rayspeed.config.load import load
from rayspeed.planner import resolve
from rayspeed.planner.oom_feedback import OomFeedback
from rayspeed.planner.search import build_ctx, evaluate
from rayspeed.train.attempt_plan import plan_attempt

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.yaml")
GIB = 1 << 30


def _record(plan, need_gib: float = 0.0, step: int = 3) -> dict:
    b = plan.best
    per = b["memory_breakdown_gib"]
    lay = plan.layout
    return {"launched_at": 1.0, "step": step, "rank": 0,
            "layout": {**lay.record(), "activation_checkpointing": lay.activation_checkpointing,
                       "sequence_parallel": lay.sequence_parallel},
            "need_bytes": int(need_gib * GIB), "predicted_bytes": int(b["memory_gib_per_gpu"] * GIB),
            "per_micro_batch_bytes": int((per["activations"] + per["logits_loss"]) * GIB)}


def test_the_layout_that_ran_out_of_memory_is_refused_and_the_next_best_chosen():
    job = load(TINY, [])
    _, first = resolve(job, world_size=2)
    record = _record(first)
    _, again = resolve(job, world_size=2, oom=OomFeedback.of([record]))
    assert again.layout != first.layout
    a, b = first.layout, again.layout
    assert a.micro_batch_size * a.grad_accum == b.micro_batch_size * b.grad_accum  # the same global batch
    # Refusing it twice over (the next one too) moves on again.
    _, third = resolve(job, world_size=2, oom=OomFeedback.of([record, _record(again)]))
    assert third.layout not in (first.layout, again.layout)


def test_a_measured_shortfall_is_added_to_layouts_of_its_kind_only_and_never_lowers_one():
    job = load(TINY, [])
    _, first = resolve(job, world_size=2)
    feedback = OomFeedback.of([_record(first, need_gib=first.best["memory_gib_per_gpu"] + 1.0)])
    memory = {"activations": 100 << 20, "logits_loss": 28 << 20, "weights": 1 << 20}
    same_kind_half = first.layout.__class__(**{**first.layout.__dict__,
                                               "micro_batch_size": first.layout.micro_batch_size // 2})
    extra = feedback.extra_bytes(same_kind_half, memory)
    per_ref = feedback.measured[0].per_micro_batch_bytes
    assert extra == int(feedback.measured[0].shortfall_bytes * (128 << 20) / per_ref) > 0
    other_kind = first.layout.__class__(**{**first.layout.__dict__, "zero_stage": 3})
    assert feedback.extra_bytes(other_kind, memory) == 0
    # A measurement below the prediction (a CPU drill: no allocator to count) corrects nothing.
    low = OomFeedback.of([_record(first, need_gib=0.01)])
    assert low.extra_bytes(same_kind_half, memory) == 0
    # In the planner's own estimates: the layouts of the kind carry it as a component of their breakdown.
    ctx = build_ctx(job, 2, oom=feedback)
    assert evaluate(ctx, same_kind_half).memory.get("measured_oom", 0) > 0
    assert "measured_oom" not in evaluate(ctx, other_kind).memory


def test_the_attempt_line_names_the_refused_layout_the_new_one_and_the_keys_the_job_fixed():
    job = load(TINY, [])  # tiny-cpu fixes parallel.zero_stage: 2
    first = plan_attempt(job, None, 2)
    ooms = [_record(first.plan)]
    again = plan_attempt(job, None, 2, ooms)
    line = again.notes[-1]
    a, b = first.layout, again.layout
    assert line.startswith("re-planned after running out of memory (1 of resilience.oom_replans 2)")
    assert f"micro-batch {a.micro_batch_size} x {a.grad_accum} (out of memory at step 3 on rank 0" in line
    assert (f"now dp {b.dp} tp {b.tp} pp {b.pp} ZeRO-{b.zero_stage} micro-batch {b.micro_batch_size} x "
            f"{b.grad_accum}") in line
    assert line.endswith("kept as the job fixes them: zero_stage") and b.zero_stage == a.zero_stage == 2
