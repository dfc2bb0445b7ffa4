"""Training-time watchdog: a NaN/Inf loss or a grad-norm spike -> skip the step or roll back.

    wd = Watchdog(policy="skip", spike_factor=10.0, window=20)       # or Watchdog.from_config(cfg.health)
    d = wd.check(step, loss, grad_norm)                               # every step, before its update
    if d.action == "skip": ...        # withhold this step's update (rayspeed.train.step_guard)
    elif d.action == "rollback": ...  # withhold it, reload the newest verified checkpoint, then wd.reset()

The watchdog only decides; the step guard and the worker loop act. Every decision other than "ok" is logged as
one line saying why. The same inputs give the same decision on every rank, so ranks never disagree: pass the
reduced loss and the global grad norm (what DeepSpeed computes), not per-rank values.

A spike is a grad norm above spike_factor x the median of the last `window` accepted norms; no spike is called
before a few norms are known (warm-up norms are large and fall fast). Skipped steps never enter the window, so
a run of bad steps cannot raise the baseline. Under "skip", `max_skips` consecutive bad steps escalate to a
rollback: skipping forever would stall a diverged run instead of recovering it.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger("rayspeed.health")

Action = Literal["ok", "skip", "rollback"]
MIN_HISTORY = 3


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    step: int = -1

    @property
    def ok(self) -> bool:
        return self.action == "ok"


class Watchdog:
    def __init__(self, policy: Literal["skip", "rollback", "off"] = "skip", spike_factor: float = 10.0,
                 window: int = 20, max_skips: int = 5, min_history: int = MIN_HISTORY):
        if policy not in ("skip", "rollback", "off"):
            raise ValueError(f"watchdog policy must be skip, rollback or off, got {policy!r}")
        if spike_factor <= 1.0:
            raise ValueError(f"spike_factor must be > 1, got {spike_factor}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.policy = policy
        self.spike_factor = float(spike_factor)
        self.window = int(window)
        self.max_skips = int(max_skips)
        self.min_history = max(1, min(int(min_history), self.window))
        self.norms: deque[float] = deque(maxlen=self.window)
        self.consecutive_bad = 0
        self.counts = {"ok": 0, "skip": 0, "rollback": 0}

    @classmethod
    def from_config(cls, health) -> "Watchdog":
        """From a HealthConfig (cfg.health)."""
        return cls(policy=health.watchdog, spike_factor=health.grad_norm_spike_factor,
                   window=health.watchdog_window, max_skips=health.watchdog_max_skips)

    def reset(self) -> None:
        """After a rollback: the window restarts from the restored state's steps."""
        self.norms.clear()
        self.consecutive_bad = 0

    def baseline(self) -> float | None:
        return statistics.median(self.norms) if len(self.norms) >= self.min_history else None

    def _problem(self, loss: float | None, grad_norm: float | None) -> str | None:
        if loss is not None and not math.isfinite(loss):
            return f"loss is {loss}"
        if grad_norm is None:
            return None
        if not math.isfinite(grad_norm):
            return f"grad norm is {grad_norm}"
        base = self.baseline()
        if base is not None and base > 0 and grad_norm > self.spike_factor * base:
            return (f"grad-norm spike: {grad_norm:.4g} > {self.spike_factor:g} x median {base:.4g} "
                    f"of the last {len(self.norms)} steps")
        return None

    def check(self, step: int, loss: float | None, grad_norm: float | None = None) -> Decision:
        """loss None: not known before the update (a pipeline's loss lives on its last stage)."""
        loss = None if loss is None else float(loss)
        grad_norm = None if grad_norm is None else float(grad_norm)
        problem = self._problem(loss, grad_norm)
        if problem is None:
            if grad_norm is not None:
                self.norms.append(grad_norm)
            self.consecutive_bad = 0
            return self._decide(step, "ok", "loss and grad norm are finite and within range", quiet=True)
        if self.policy == "off":
            return self._decide(step, "ok", f"{problem}; watchdog is off, the step is kept")
        self.consecutive_bad += 1
        if self.policy == "rollback":
            return self._decide(step, "rollback", f"{problem}: rolling back to the last verified checkpoint")
        if self.max_skips and self.consecutive_bad > self.max_skips:
            self.consecutive_bad = 0
            return self._decide(step, "rollback", f"{problem}, {self.max_skips + 1} bad steps in a row: skipping "
                                "does not recover, rolling back to the last verified checkpoint")
        return self._decide(step, "skip", f"{problem}: skipping this step's update "
                            f"({self.consecutive_bad} in a row)")

    def _decide(self, step: int, action: Action, reason: str, quiet: bool = False) -> Decision:
        self.counts[action] += 1
        # One line per decision: problems at WARNING, healthy steps at DEBUG (one per step would drown the log).
        log.log(logging.DEBUG if quiet else logging.WARNING, "watchdog: step %d %s: %s", step, action, reason)
        return Decision(action=action, reason=reason, step=step)

    def state_dict(self) -> dict:
        """For checkpoints: the window survives a restart."""
        return {"norms": list(self.norms), "consecutive_bad": self.consecutive_bad, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.norms = deque((float(x) for x in state.get("norms", [])), maxlen=self.window)
        self.consecutive_bad = int(state.get("consecutive_bad", 0))
        self.counts.update(state.get("counts", {}))
