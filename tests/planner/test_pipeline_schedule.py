"""The planner's pipeline time against DeepSpeed's own 1F1B schedule run with fixed durations, not CPU wall time.

Each stage executes TrainSchedule's instruction stream (DeepSpeed 0.19.8, the engine rayspeed runs) in order: a
forward costs F, a backward B, a send and its receive meet (a send waits for its receive) and both finish the
transfer time L after the later of the two arrives. The simulated step is the last stage's finish. The planner's
parts (rayspeed.planner.pipeline_schedule): one_f_one_b's compute and bubble, and critical_sends transfers.
"""

from __future__ import annotations

import random

import pytest

from rayspeed.config.layout import Layout
from rayspeed.planner.pipeline_schedule import critical_sends, one_f_one_b

SENDS = {"SendActivation": (1, "RecvActivation"), "RecvActivation": (-1, "SendActivation"),
         "SendGrad": (-1, "RecvGrad"), "RecvGrad": (1, "SendGrad")}
TIMED = ("ForwardPass", "BackwardPass", *SENDS)


def streams(p: int, m: int) -> list[list[str]]:
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    return [[type(c).__name__ for step in TrainSchedule(micro_batches=m, stages=p, stage_id=s) for c in step
             if type(c).__name__ in TIMED] for s in range(p)]


def simulated_step(F: list[float], B: list[float], L: float, m: int) -> float:
    p = len(F)
    ins, t, pc = streams(p, m), [0.0] * p, [0] * p

    def at(i: int) -> str | None:
        return ins[i][pc[i]] if pc[i] < len(ins[i]) else None

    moved = True
    while moved:
        moved = False
        for i in range(p):
            while (op := at(i)) is not None:
                if op in ("ForwardPass", "BackwardPass"):
                    t[i] += F[i] if op == "ForwardPass" else B[i]
                else:
                    j = i + SENDS[op][0]
                    if at(j) != SENDS[op][1]:
                        break  # waits for its neighbour
                    t[i] = t[j] = max(t[i], t[j]) + L
                    pc[j] += 1
                pc[i] += 1
                moved = True
    assert all(pc[i] == len(ins[i]) for i in range(p)), "the schedule deadlocked"
    return max(t)


def planned_step(F: list[float], B: list[float], L: float, m: int) -> float:
    compute, bubble = one_f_one_b([f + b for f, b in zip(F, B)], m)
    return compute + bubble + critical_sends(len(F), m) * L


@pytest.mark.parametrize("p", [2, 3, 4, 8, 16])
def test_equal_stages_take_what_the_schedule_takes(p):
    for m in range(1, 4 * p + 1):
        for f, b in ((1.0, 1.0), (1.0, 2.0), (1.0, 3.0)):
            for L in (0.0, 0.05, 0.3, 1.0):
                sim, plan = simulated_step([f] * p, [b] * p, L, m), planned_step([f] * p, [b] * p, L, m)
                assert plan == pytest.approx(sim, rel=1e-12), (p, m, f, b, L)


def test_unequal_stages_are_never_planned_faster_than_the_schedule():
    rng = random.Random(0)
    worst = 0.0
    for _ in range(150):
        p = rng.choice([2, 3, 4, 8, 16])
        m = rng.choice([1, 2, p, 2 * p, 4 * p])
        F = [rng.uniform(0.8, 1.2) for _ in range(p)]
        B = [2 * f for f in F]
        for L in (0.0, 0.1):
            sim, plan = simulated_step(F, B, L, m), planned_step(F, B, L, m)
            assert plan >= sim * (1 - 1e-12), (p, m, L)
            worst = max(worst, plan / sim - 1)
    assert worst <= 0.11, worst


def test_the_step_time_charges_the_critical_sends():
    """timing.step_time's pp_p2p_s is critical_sends transfers of one micro-batch's hidden states."""
    from _cluster import ROOT
    from rayspeed.config.load import load
    from rayspeed.planner.model_math import local_tokens
    from rayspeed.planner.search import build_ctx
    from rayspeed.planner.timing import p2p_s, step_time

    ctx = build_ctx(load(str(ROOT / "configs" / "llama-7b-16xh200.yaml")), 16)
    for pp, m in ((2, 4), (4, 1), (4, 16), (8, 8)):
        lay = Layout(dp=16 // pp, tp=1, pp=pp, zero_stage=1, micro_batch_size=1, grad_accum=m)
        c, lay_ = ctx.in_rows(lay)
        one = p2p_s(c, lay_, local_tokens(c.shape, lay_) * c.shape.hidden_size * c.w_bytes)
        assert step_time(ctx, lay).pp_p2p_s == pytest.approx(critical_sends(pp, m) * one, rel=1e-9), (pp, m)
