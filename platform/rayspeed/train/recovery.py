"""Resilience accounting on the workers: the step reached (for the steps a failure loses), and at this attempt's
first step the restarts Ray Train's controller recorded and the recovery it closes (failure seen -> first step
done), with the cause of the restart as a run tag, and where the seconds went (rayspeed.train.timeline): the start's
phases from the command, or the recovery's from the failure. The controller side is rayspeed.train.resilience."""

from __future__ import annotations

import logging
import time
from typing import Any

from rayspeed.train import resilience
from rayspeed.train.events import Callback, TrainState
from rayspeed.train.timeline import start_line

log = logging.getLogger("rayspeed.worker")


class RecoveryCallback(Callback):
    def __init__(self, ctx: Any, tracker: Any, attempt_started: float, phases: dict[str, float] | None = None,
                 payload: Any = None):
        """phases: this worker's start, phase by phase (rayspeed.train.worker); payload: the launcher's."""
        self.ctx, self.tracker, self.attempt_started = ctx, tracker, attempt_started
        self.phases, self.payload = dict(phases or {}), payload
        self.progress = resilience.ProgressRecorder(ctx.experiment_dir) if ctx.is_rank0 else None
        self.first_step_done = False

    def on_step_end(self, state: TrainState) -> None:
        if not self.first_step_done:
            self.first_step_done = True
            if self.ctx.is_rank0:
                self.first_step(state)
        if self.progress is not None:
            self.progress.update(state.step)

    def first_step(self, state: TrainState) -> None:
        now, exp = time.time(), self.ctx.experiment_dir
        restarts = resilience.count_restarts(exp)
        state.restarts_seen = restarts
        metrics: dict[str, float] = {"resilience/world_size": self.ctx.world_size, "resilience/restarts": restarts}
        # Whatever failed before (even before the first checkpoint): this first step ends its recovery.
        event = resilience.pending_event(exp)
        if event is not None:
            recovery = now - event["time"]
            progress = resilience.read_progress(exp)
            resumed_at = state.start_step
            lost = max(0, int(progress.get("step", resumed_at)) - resumed_at)
            metrics.update({"resilience/recovery_s": recovery, "resilience/lost_steps": lost})
            cause = event.get("kind", "restart")
            if event.get("causes"):
                cause += ": " + "; ".join(f"rank {r}: {c}" for r, c in event["causes"].items())
            self.tracker.set_tags({f"rayspeed.restart.{restarts}": cause[:4000]})
            resilience.mark_recovered(exp, {"recovery_s": recovery, "lost_steps": lost, "step": state.step})
            log.info("recovered in %.1f s from %s (%d steps lost; this attempt started %.1f s after it)",
                     recovery, event.get("kind"), lost, self.attempt_started - event["time"])
            state.recovery_s = recovery
        metrics.update(self.timeline(now, event["time"] if event is not None else None))
        self.tracker.log_metrics(metrics, step=state.step)

    def timeline(self, now: float, failed_at: float | None) -> dict[str, float]:
        """startup/<phase>_s from the command (the submission's first attempt), or recovery/<phase>_s from the
        failure the controller saw; one line saying it."""
        worker = {**self.phases, "first_step": max(0.0, now - self.attempt_started - sum(self.phases.values()))}
        if failed_at is not None:
            kind, origin = "recovery", failed_at
            phases = {"restart": self.attempt_started - failed_at, **worker}
        else:
            p = self.payload
            if p is None or p.handed_at is None:
                return {}
            kind, origin = "start", p.launched_at
            phases = {**p.start_phases, "worker_start": self.attempt_started - p.handed_at, **worker}
        log.info("%s", start_line(phases, now - origin, kind))
        prefix = "startup" if kind == "start" else "recovery"
        return {**{f"{prefix}/{k}_s": v for k, v in phases.items()}, f"{prefix}/total_s": now - origin}

    def on_end(self, state: TrainState) -> None:
        self._close()

    def on_failure(self, state: TrainState, error: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.progress is not None:
            self.progress.close()
