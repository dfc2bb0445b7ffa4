"""Failures and resizes: recorded where the controller sees them, measured where training resumes.

The controller side (`ResilienceCallback`, running in Ray Train's controller actor) appends one line per
event to `<storage>/<name>/.resilience/events.jsonl` the moment it sees a worker failure or decides to
resize. The restarted rank 0 reads the newest unhandled event, and once its first step is done logs
`resilience/recovery_s` (event -> first step done), lost steps, the world size and the cause.

All of it goes through rayspeed.storage, so the experiment may live on an object store (each file
then has one writer: events.jsonl the controller, handled.jsonl and progress.json rank 0).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from rayspeed import compat, paths
from rayspeed.storage import Location, locate

log = logging.getLogger(__name__)

EVENTS = "events.jsonl"
HANDLED = "handled.jsonl"


def resilience_dir(experiment_dir: str | Path | Location) -> Location:
    return locate(experiment_dir).child(paths.RESILIENCE_DIR)


_ControllerCallback, _WorkerGroupCallback = compat.controller_callback_bases()


# Ray Train's internal callback classes, resolved at run time through compat: mypy takes no variable as a base.
class ResilienceCallback(_ControllerCallback, _WorkerGroupCallback):  # type: ignore[misc, valid-type]
    """Runs in the Ray Train controller: timestamps failures and resize decisions as they happen."""

    def after_controller_start(self, train_run_context) -> None:
        compat.count_live_workers_only()
        if self.capacity_message:
            compat.fail_after_capacity_wait(self.capacity_wait_s, self.capacity_message)

    def __init__(self, experiment_dir: str, capacity_wait_s: float = 600.0, capacity_message: str = ""):
        self.dir = str(resilience_dir(experiment_dir))  # a str: the callback is pickled to the controller
        self.capacity_wait_s, self.capacity_message = capacity_wait_s, capacity_message
        self._failure_seen = False
        self._group_started = False  # the first "resize" is the initial start, not an incident

    def _record(self, kind: str, **fields: Any) -> None:
        try:
            locate(self.dir).append_jsonl(EVENTS, {"kind": kind, "time": time.time(), **fields})
        except Exception as e:  # never break the controller
            log.warning("rayspeed: could not record %s event: %s", kind, e)

    def after_worker_group_poll_status(self, worker_group_status) -> None:
        errors = getattr(worker_group_status, "errors", None)
        if errors and not self._failure_seen:
            self._failure_seen = True
            causes = {str(r): f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                      for r, e in errors.items()}
            self._record("failure", ranks=sorted(int(r) for r in errors), causes=causes)
        elif not errors:
            self._failure_seen = False

    def before_controller_execute_resize_decision(self, resize_decision) -> None:
        # The first decision is the initial start; one that restarts a failed group belongs to that failure's
        # incident (already recorded); any other is a resize of a running job (it grows into new capacity).
        if self._group_started and not self._failure_seen:
            self._record("resize", num_workers=int(getattr(resize_decision, "num_workers", 0)))
        self._group_started = True
        self._failure_seen = False


def pending_event(experiment_dir: str | Path) -> dict[str, Any] | None:
    """The earliest failure/resize event not yet followed by a recovery: where the incident began (a
    failed restart attempt adds events, but recovery is measured from the first)."""
    d = resilience_dir(experiment_dir)
    handled = {round(h["event_time"], 6) for h in d.read_jsonl(HANDLED) if "event_time" in h}
    for e in d.read_jsonl(EVENTS):
        if e.get("kind") in ("failure", "resize") and round(e["time"], 6) not in handled:
            return e
    return None


def count_restarts(experiment_dir: str | Path) -> int:
    """Restarts of this job: the failures and resizes the Ray Train controller recorded (a failure before the
    first checkpoint counts too; a new submission is not a restart)."""
    return sum(1 for e in resilience_dir(experiment_dir).read_jsonl(EVENTS) if e.get("kind") in ("failure", "resize"))


def close_incidents(experiment_dir: str | Path, why: str) -> int:
    """Mark every pending event handled without a recovery (a new submission starts: an old incident's clock must
    not run into it). Returns how many were closed."""
    n = 0
    while pending_event(experiment_dir) is not None:
        mark_recovered(experiment_dir, {"recovery_s": None, "closed": why})
        n += 1
    return n


def mark_recovered(experiment_dir: str | Path, record: dict[str, Any]) -> None:
    """Every event recorded so far belongs to the incident that just recovered."""
    d = resilience_dir(experiment_dir)
    handled = {round(h["event_time"], 6) for h in d.read_jsonl(HANDLED) if "event_time" in h}
    for e in d.read_jsonl(EVENTS):
        if round(e["time"], 6) not in handled:
            d.append_jsonl(HANDLED, {"event_time": e["time"], **record})


def write_progress(experiment_dir: str | Path, step: int) -> None:
    """Rank 0's last completed step (for lost-steps accounting); a tiny atomic file (one request on an object
    store). The training loop calls it through `ProgressRecorder`, never once per step."""
    resilience_dir(experiment_dir).write_json("progress.json", {"step": step, "time": time.time()})


def read_progress(experiment_dir: str | Path) -> dict[str, Any]:
    return resilience_dir(experiment_dir).read_json("progress.json")


class ProgressRecorder:
    """Rank 0's last completed step, published by a daemon thread at most every `interval_s`.

    The training thread only stores an int. Writing the file on every step cost 2.5% of rank 0's training
    thread on the CPU demo (py-spy, 45 ms steps), and every other rank waits for rank 0 at the next
    all-reduce; on an object store it would be one request per step. When a peer dies, rank 0 sits in a
    collective for seconds, so the thread still publishes the last step; only a hard kill of rank 0 itself
    can leave the record up to `interval_s` behind (lost_steps then reads low by those steps).
    """

    def __init__(self, experiment_dir: str | Path, interval_s: float = 1.0):
        self._warned = False
        self._dir = experiment_dir
        # None until the first update: the previous attempt's progress.json must survive until this attempt's
        # first step has read it (lost_steps), so nothing is written before then.
        self._step: int | None = None
        self._written: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._interval = interval_s
        self._thread = threading.Thread(target=self._run, name="rayspeed-progress", daemon=True)
        self._thread.start()

    def update(self, step: int) -> None:
        self._step = step

    def flush(self) -> None:
        with self._lock:
            step = self._step
            if step is not None and step != self._written:
                try:
                    write_progress(self._dir, step)
                    self._written = step
                except Exception as e:  # accounting only (a local disk or a bucket): never fail training
                    if not self._warned:
                        log.warning("could not write progress to %s: %s", self._dir, e)
                        self._warned = True

    def close(self) -> None:
        self._stop.set()
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()
