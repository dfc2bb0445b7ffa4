"""Predicted against measured, for every job: the metrics a run logs so the planner can learn from it.

    plan_metrics(plan, windows, measured_memory_gib=None) -> {"plan/predicted_step_time_s", "plan/predicted_memory_gib",
                                                           "plan/measured_step_time_s", "plan/measured_memory_gib", ...}

`windows`: the trainer's timing windows, (last step, steps in the window, seconds per step). The measured step
time is the median over steady-state windows: those that start after WARMUP_STEPS (the first steps build
optimizer state, warm allocator caches and compile kernels, none of which the time model covers).
"""

from __future__ import annotations

import statistics
from typing import Iterable, Optional

WARMUP_STEPS = 10


def steady_step_time(windows: Iterable[tuple[int, int, float]], warmup_steps: int = WARMUP_STEPS) -> Optional[float]:
    """Median seconds per step of the windows that start after `warmup_steps`; None before there is one."""
    steady = [float(s) for last, n, s in windows if last - n + 1 > warmup_steps and n > 0 and s > 0]
    return statistics.median(steady) if steady else None


def plan_metrics(plan: dict, windows: Iterable[tuple[int, int, float]], measured_memory_gib: Optional[float] = None,
                 warmup_steps: int = WARMUP_STEPS) -> dict[str, float]:
    out: dict[str, float] = {}
    pred_t, pred_m = plan.get("step_time_s"), plan.get("memory_gib_per_gpu")
    if pred_t:
        out["plan/predicted_step_time_s"] = float(pred_t)
    if pred_m is not None:
        out["plan/predicted_memory_gib"] = float(pred_m)
    meas = steady_step_time(windows, warmup_steps)
    if meas is not None:
        out["plan/measured_step_time_s"] = meas
        if pred_t:
            out["plan/step_time_error"] = float(pred_t) / meas - 1.0
    if measured_memory_gib is not None:
        out["plan/measured_memory_gib"] = float(measured_memory_gib)
        if pred_m:
            out["plan/memory_error"] = float(pred_m) / measured_memory_gib - 1.0
    return out
