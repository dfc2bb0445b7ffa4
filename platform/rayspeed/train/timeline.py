"""Where a start's seconds go, from the command to the first step, phase by phase: the launcher's (the interpreter
and its imports, the job file, the plan, the launch checks, Ray, the data, the MLflow run), the hand-off to the
workers (Ray Train's controller, placement and worker processes, their process group), each worker's own (imports,
process groups, data, engine, resume, preflight) and the first step. Rank 0 logs them at the first step as
`startup/<phase>_s` (and `startup/total_s`) with one line; an attempt that recovers from a failure logs
`recovery/<phase>_s` instead, from the failure the controller saw to its first step.

    clock = Timeline.since_process_start()     # the launcher
    ...; clock.mark("config")                  # each phase: the seconds since the previous mark
    payload.start_phases, payload.handed_at = clock.phases, time.time()

Times on the workers are read against the launcher's clock: across nodes their clocks' difference is in
`worker_start`."""

from __future__ import annotations

import time
from typing import Optional


class Timeline:
    def __init__(self, started: float):
        self.started = self.last = started
        self.phases: dict[str, float] = {}

    @classmethod
    def since_process_start(cls) -> "Timeline":
        """From this process's start (the command), so the interpreter and the imports before any rayspeed code
        count too."""
        try:
            import psutil

            return cls(psutil.Process().create_time())
        except Exception:  # no psutil: from now
            return cls(time.time())

    def mark(self, phase: str, now: Optional[float] = None) -> float:
        now = time.time() if now is None else now
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now
        return now


def start_line(phases: dict[str, float], total: float, kind: str = "start") -> str:
    """One line: `start: 18.2 s from the command to the first step (interpreter 1.1 s, ...)`."""
    what = "from the command to the first step" if kind == "start" else "from the failure to the first step"
    return f"{kind}: {total:.1f} s {what} (" + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()) + ")"
