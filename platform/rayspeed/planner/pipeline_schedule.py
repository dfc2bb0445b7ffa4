"""DeepSpeed's 1F1B pipeline schedule as time: the slots of the stages and the sends on the critical path.

DeepSpeed 0.19.8's TrainSchedule has every stage run its forwards, backwards and sends in a fixed order, and a send
waits for its receive (gloo's send, and NCCL's on the stream the next kernels run on): a send is a rendezvous of two
neighbouring stages that costs both the transfer time. With stages of equal slots (forward + backward) F + B and a
transfer time L, the step is exactly

    m (F + B) + (p - 1)(F + B) + sends(p, m) L

where sends(p, m) counts the transfers on the critical path: 2m with two stages (each does two per micro-batch);
from three stages on, an inner stage receives and sends an activation and a gradient per micro-batch, four
rendezvous, and the first micro-batch crosses every stage and back: 2(p - 1) for one micro-batch, 2p + 4m - 8 for
more. tests/planner/test_pipeline_schedule.py runs TrainSchedule's own instruction streams with fixed durations and
checks this to the last digit for p 2-16, m 1-4p, several F/B ratios and latencies; with unequal stages the
compute part (m slots of the slowest, one of each other) is never below the simulated one and at most 11% above.
"""

from __future__ import annotations


def critical_sends(p: int, m: int) -> int:
    """Point-to-point transfers on the step's critical path of a p-stage 1F1B schedule over m micro-batches."""
    if p <= 1:
        return 0
    if p == 2:
        return 2 * m
    return 2 * (p - 1) if m == 1 else 2 * p + 4 * m - 8


def one_f_one_b(slots: list[float], m: int) -> tuple[float, float]:
    """(compute, bubble) of m micro-batches through stages whose per-micro-batch slots are `slots`: m slots of the
    slowest stage, and one of every other stage for the first micro-batch's way through (the fill and drain)."""
    worst = max(slots)
    return m * worst, sum(slots) - worst
