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


def memory_check(plan: dict, measured_gib: float) -> tuple[bool, str]:
    """Step 1's peak memory against the plan: (over the margin, one line). Over means the measured worst rank
    needs more than the prediction plus the memory model's own margin (planner/margin.py)."""
    pred = float(plan.get("memory_gib_per_gpu") or 0.0)
    margin = float(plan.get("memory_margin_gib") or 0.0)
    usable = plan.get("usable_memory_gib")
    if pred <= 0:
        return False, f"memory: step 1 peaked at {measured_gib:.1f} GiB on the worst rank (no prediction to compare)"
    if measured_gib > pred + margin:
        return True, (f"MEMORY: step 1 peaked at {measured_gib:.1f} GiB on the worst rank, over the plan's "
                      f"{pred:.1f} GiB +- {margin:.1f}" + (f" ({usable:.1f} usable)" if usable else "")
                      + ": the memory model misses something for this job; a longer run may run out of memory "
                      "(lower parallel.micro_batch_size or raise activation_checkpointing, and report it)")
    return False, (f"memory: step 1 peaked at {measured_gib:.1f} GiB on the worst rank, within the plan's "
                   f"{pred:.1f} GiB +- {margin:.1f}")
