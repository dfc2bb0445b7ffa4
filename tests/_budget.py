"""The suite's time budget (tests/time_budget.yaml): seconds per test module (setup, call and teardown of its
tests together), compared at the end of a session when RAYSPEED_TIME_BUDGET is set (CI sets it).

A module over `tolerance` x its budget, or a module with no budget that takes more than `unbudgeted_s`, fails the
session with a table saying which and by how much: a feature's tests come with their budget (its issue states it),
and a slower suite is a decision made in the budget file, not found at the 90-minute limit.

The whole is held too: with RAYSPEED_TIME_SPENT naming a file (.ci/run makes one per run), each session adds its
modules' seconds and its own wall-clock seconds (a `(wall) ...` entry) to it, and a session fails when the sessions'
wall seconds (this session and the earlier ones of the same run: make test, make test-slow, make test-multinode)
pass `total_s`. Module by module, a suite can grow a little everywhere and double without one module passing its
tolerance. Wall seconds, not the modules' sum: `make test` runs modules in two processes at once (pytest-xdist), so
the modules' seconds add up to more than the run takes, and the run's length is what CI's limit holds.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

BUDGET_FILE = Path(__file__).with_name("time_budget.yaml")
ENV = "RAYSPEED_TIME_BUDGET"
SPENT_ENV = "RAYSPEED_TIME_SPENT"  # a JSON file the session's seconds per module are added to (for the budget)
WALL = "(wall) "  # the spent file's keys of the sessions' own wall-clock seconds


class Budget:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.spent: dict[str, float] = defaultdict(float)
        self.over: list[str] | None = None  # the problems, once checked at the end of the session
        self.written = False  # this session's seconds are in the spent file

    def add(self, nodeid: str, seconds: float) -> None:
        self.spent[nodeid.split("::")[0]] += seconds

    def write_spent(self) -> None:
        import json

        path = os.environ.get(SPENT_ENV)
        if not path or not self.spent:
            return
        old = json.loads(Path(path).read_text()) if Path(path).exists() else {}
        for k, v in self.spent.items():  # added: a module can run in make test and in make test-slow
            old[k] = round(old.get(k, 0.0) + v, 1)
        old[f"{WALL}session {sum(k.startswith(WALL) for k in old) + 1}"] = round(self.wall(), 1)
        Path(path).write_text(json.dumps(old, indent=1, sort_keys=True))
        self.written = True

    def wall(self) -> float:
        return time.monotonic() - self.started

    def total(self) -> float:
        """Wall-clock seconds of this run so far: the spent file's sessions (earlier ones and this one), else this
        session's."""
        import json

        path = os.environ.get(SPENT_ENV)
        earlier = json.loads(Path(path).read_text()) if path and Path(path).exists() else {}
        return float(sum(v for k, v in earlier.items() if k.startswith(WALL))) + (0.0 if self.written else self.wall())

    def problems(self) -> list[str]:
        import yaml

        spec = yaml.safe_load(BUDGET_FILE.read_text())
        tolerance, free = float(spec["tolerance"]), float(spec["unbudgeted_s"])
        total, limit = self.total(), float(spec["total_s"])
        budgets = spec["modules"]
        out = []
        for module, s in sorted(self.spent.items(), key=lambda kv: -kv[1]):
            b = budgets.get(module)
            if b is None and s > free:
                out.append(f"{module}: {s:.0f} s and no budget (over {free:.0f} s: give it one in {BUDGET_FILE.name})")
            elif b is not None and s > tolerance * b:
                out.append(f"{module}: {s:.0f} s, over {tolerance:g} x its budget of {b:.0f} s")
        if total > limit:
            out.append(f"the whole suite so far: {total:.0f} s, over its total_s of {limit:.0f} s "
                       f"({limit / 60:.0f} minutes; {SPENT_ENV} adds up every session of the run)")
        return out


def enabled() -> bool:
    return bool(os.environ.get(ENV))
