"""The order in which the planner picks among the layouts that fit: speed first, memory to spare within the time
model's own error, the simpler layout within a near tie. Each constant's reasoning is in docs/PLANNER.md."""

from __future__ import annotations

from rayspeed.config.layout import CHECKPOINT_MODES
from rayspeed.planner.inputs import Ctx
from rayspeed.planner.search import Estimate

NEAR_TIE = 0.01  # within 1% the model cannot tell layouts apart: prefer the simpler one (see `preference`)
# Within 3% of the fastest layout that fits with the margin, the one with the most memory to spare is picked: the
# time model's own error on the best layouts is several percent (DEFAULT_MODEL_ERROR), so a 3% gain is within what
# it cannot promise, while memory to spare is what keeps a step from running out (docs/PLANNER.md).
HEADROOM_TIE = 0.03
# The model's own error without a fitted profile: the H200 anchor rows are predicted within -4%..+13%.
DEFAULT_MODEL_ERROR = 0.10


def preference(e: Estimate) -> tuple:
    """Order among near ties: less accumulation (bigger micro-batches, more DP), smaller tp and pp, lower ZeRO,
    cheaper checkpointing."""
    lay = e.layout
    return (lay.grad_accum, lay.tp, lay.pp, lay.zero_stage, CHECKPOINT_MODES.index(lay.activation_checkpointing))


def model_error(ctx: Ctx) -> float:
    """The time model's own relative error: the profile's held-out error when it was fitted, else the default."""
    return ctx.model_error if ctx.model_error > 0 else DEFAULT_MODEL_ERROR


def headroom(e: Estimate) -> float:
    """Free fraction of usable memory on the worst rank."""
    return max(0.0, 1.0 - e.memory_gib / max(e.ctx.usable_gib, 1e-9))


def _fastest_first(group: list[Estimate]) -> list[Estimate]:
    """Fastest first; within NEAR_TIE of the fastest the simpler one (`preference`)."""
    group = sorted(group, key=lambda e: e.step_s)
    if not group:
        return []
    best_t = group[0].step_s
    head = sorted((e for e in group if e.step_s <= best_t * (1 + NEAR_TIE)), key=preference)
    taken = {id(e) for e in head}
    return head + [e for e in group if id(e) not in taken]


def spare_gib(e: Estimate) -> float:
    """Usable memory left on the worst rank once the estimate's margin is counted."""
    return e.ctx.usable_gib - e.memory_gib - e.margin_gib


def _roomiest_first(group: list[Estimate]) -> list[Estimate]:
    """Within HEADROOM_TIE of the fastest, the most memory to spare first (equal room: the simpler); then the rest,
    fastest first."""
    if not group:
        return []
    best_t = min(e.step_s for e in group)
    head = sorted((e for e in group if e.step_s <= best_t * (1 + HEADROOM_TIE)),
                  key=lambda e: (-round(spare_gib(e), 6), preference(e), e.step_s))
    taken = {id(e) for e in head}
    return head + _fastest_first([e for e in group if id(e) not in taken])


def rank(estimates: list[Estimate]) -> list[Estimate]:
    """Fitting estimates in the order the planner picks them: those that fit with the memory model's margin
    (`Estimate.safe`) first, and among them, within 3% of the fastest, the one with the most memory to spare;
    then those that fit only within the margin, fastest first (within 1% the simpler one)."""
    fit = [e for e in estimates if e.fits]
    return _roomiest_first([e for e in fit if e.safe]) + _fastest_first([e for e in fit if not e.safe])
