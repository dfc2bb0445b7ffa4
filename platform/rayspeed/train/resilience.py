"""Failures and resizes: recorded where the controller sees them, measured where training resumes.

The controller side (`ResilienceCallback`, running in Ray Train's controller actor) appends one line per
event to `<storage>/<name>/.resilience/events.jsonl` the moment it sees a worker failure or decides to
resize. The restarted rank 0 reads the newest unhandled event, and once its first step is done logs
`resilience/recovery_s` (event -> first step done), lost steps, the world size and the cause.
The batch policy for a changed world lives here too.

All of it goes through rayspeed.storage, so the experiment may live on an object store (each file
then has one writer: events.jsonl the controller, handled.jsonl and progress.json rank 0).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

from rayspeed.storage import Location, locate
from rayspeed.config.schema import JobConfig

log = logging.getLogger(__name__)

EVENTS = "events.jsonl"
HANDLED = "handled.jsonl"


def resilience_dir(experiment_dir: str | Path | Location) -> Location:
    return locate(experiment_dir).child(".resilience")


def count_live_workers_only() -> None:
    """Make Ray Train's elastic sizing count only nodes that are alive.

    After a node dies, the autoscaling coordinator's reservations still list it for a while, so the elastic
    policy retries the old size and waits out the whole worker-group start timeout for capacity that is
    gone (64 s measured). Filtering the reservations by the GCS's live-node table makes the first restart
    decision use the world that actually exists. Applied once, in the controller process."""
    from ray.train.v2._internal.execution.scaling_policy import elastic

    policy = elastic.ElasticScalingPolicy
    if getattr(policy._count_possible_workers, "_rayspeed_live_only", False):
        return
    original = policy._count_possible_workers

    def _count(self, reserved_resources):
        try:
            import ray

            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            live = {k: v for k, v in reserved_resources.items() if k in alive}
            if len(live) != len(reserved_resources):
                log.warning("rayspeed: ignoring reservations on %d dead node(s) when sizing the worker group",
                            len(reserved_resources) - len(live))
            reserved_resources = live
        except Exception as e:  # fall back to Ray's own view
            log.warning("rayspeed: could not read live nodes (%s); using Ray's reservations", e)
        return original(self, reserved_resources)

    _count._rayspeed_live_only = True  # type: ignore[attr-defined]
    policy._count_possible_workers = _count


class ResilienceCallback(ControllerCallback, WorkerGroupCallback):
    """Runs in the Ray Train controller: timestamps failures and resize decisions as they happen."""

    def after_controller_start(self, train_run_context) -> None:
        count_live_workers_only()

    def __init__(self, experiment_dir: str):
        self.dir = str(resilience_dir(experiment_dir))  # a str: the callback is pickled to the controller
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
            causes = {str(r): f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}" for r, e in errors.items()}
            self._record("failure", ranks=sorted(int(r) for r in errors), causes=causes)
        elif not errors:
            self._failure_seen = False

    def before_controller_execute_resize_decision(self, resize_decision) -> None:
        if self._group_started:
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


def apply_batch_policy(job: JobConfig, world_size: int) -> tuple[JobConfig, str]:
    """keep_global: the same global batch (accumulation absorbs the change). playbook: PLAYBOOK B.11,
    new_batch = batch * (1 - lost/total) ** 0.8 with total = the requested workers, and the learning rate
    scaled by sqrt(new/old) (the square-root rule the lr rule itself uses)."""
    total = job.cluster.max_workers
    policy = job.resilience.batch_policy
    if policy == "keep_global" or world_size >= total:
        return job, f"batch policy {policy}: global batch {job.train.global_batch_size} kept (world {world_size}/{total})"
    lost = total - world_size
    g0 = job.train.global_batch_size
    want = g0 * (1 - lost / total) ** 0.8
    g = max(1, int(round(want)))
    # The planner needs G divisible by dp x micro-batch; round down to a multiple of the world size.
    step = max(1, world_size)
    g = max(step, (g // step) * step)
    train = replace(job.train, global_batch_size=g)
    if job.train.lr != "auto":
        train = replace(train, lr=float(job.train.lr) * math.sqrt(g / g0), min_lr=job.train.min_lr * math.sqrt(g / g0))
    line = (f"batch policy playbook: {lost} of {total} workers lost -> global batch {g0} x (1 - {lost}/{total})^0.8 "
            f"= {want:.1f}, rounded to {g} (a multiple of the world size {world_size}); lr scaled by sqrt({g}/{g0})")
    return replace(job, train=train), line
