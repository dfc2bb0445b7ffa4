"""The background half of an asynchronous save (resilience.checkpoint_mode async), under the manifest protocol.

Training stopped only for the snapshot (rayspeed.checkpoint.host_copy); each rank then runs `run(job)` on one
background thread, which never issues a collective on the training process group; the ranks meet through files:

1. write the captured DeepSpeed files and this rank's RNG file, with DeepSpeed's own serializer (the bytes a
   synchronous save writes);
2. make them durable: local/NFS storage: fsync, size and sha256 of each (manifest.durable_entries); object store:
   size and sha256 on local staging, upload, check every uploaded object's size, and only then delete the staging
   copy;
3. report: a done-marker `<experiment>/.checkpoint_done/<name>/rank<R>.json` with its files' sizes and sha256
   (or the error that stopped it); a rank's before_manifest drill point is just before it (rank 0's: after every
   marker is in), so a kill at before_manifest on any rank leaves the checkpoint uncommitted, as in a sync save;
4. rank 0 waits for every rank's marker (at most `timeout_s`), checks that every listed file is there with its
   size, writes the manifest and (local storage) renames the folder into place: the commit; then prunes. The other
   ranks wait for that manifest, recognised by this save's id, to appear.

A crash at any point leaves the previous verified checkpoint or this one: nothing is loaded without the manifest,
and the manifest is written only after every rank's files are durable.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from rayspeed.checkpoint import manifest, rng
from rayspeed.checkpoint.placement import placement_for
from rayspeed.storage import Location

log = logging.getLogger("rayspeed.checkpoint")

MARKERS = ".checkpoint_done"
ABANDONED = "abandoned.json"


@dataclass
class AsyncJob:
    step: int
    name: str
    save_id: str
    """Rank 0's id for this save, in its manifest: the other ranks recognise the commit by it."""
    rank: int
    world: int
    exp: Location
    folder: Path
    """Where this rank writes: the shared hidden .saving folder (local storage) or its node-local staging folder."""
    captured: list[tuple[str, Any]]
    """(path, host snapshot) of every file DeepSpeed would have written on this rank."""
    write: Callable[[Any, str], None]
    rng_state: dict[str, Any]
    claimed: list[str] = field(default_factory=list)
    """Files already in the folder that this rank commits (rank 0: those DeepSpeed copied in directly)."""
    meta: Optional[dict[str, Any]] = None
    """Rank 0: the manifest's metadata."""
    keep: int = 2
    timeout_s: float = 600.0
    """How long rank 0 waits for the slowest rank's marker after its own part (the others wait twice as long)."""
    drill: Callable[[int, str], None] = lambda step, point: None
    stall_s: float = 0.0
    poll_s: float = 0.2
    placement: Any = None
    """How this experiment's files are made durable and committed (rayspeed.checkpoint.placement); by its kind
    when not given."""

    def __post_init__(self) -> None:
        if self.placement is None:
            self.placement = placement_for(self.exp)


@dataclass
class AsyncResult:
    step: int
    name: str
    stall_s: float
    write_s: float
    nbytes: int
    """Bytes of the checkpoint: every rank's files on rank 0, this rank's elsewhere."""


def marker_dir(exp: Location, name: str) -> Location:
    return exp.child(f"{MARKERS}/{name}")


def clear_markers(exp: Location, name: Optional[str] = None) -> None:
    """Rank 0, before a save (the folder of `name`) and after a commit (every save's, none is in flight then)."""
    exp.delete(f"{MARKERS}/{name}" if name else MARKERS)


def run(job: AsyncJob) -> AsyncResult:
    t0 = time.perf_counter()
    markers = marker_dir(job.exp, job.name)
    try:
        mine = _write_own(job)
        job.drill(job.step, "after_shards")
        if job.rank != 0:  # a rank that dies here has not reported: nothing commits (as in a sync save's barrier)
            job.drill(job.step, "before_manifest")
        markers.write_json(f"rank{job.rank}.json", {"rank": job.rank, "files": mine})
    except Exception as e:
        _best_effort(markers, f"rank{job.rank}.json", {"rank": job.rank, "error": _why(e)})
        if job.rank == 0:  # the others stop waiting for a commit that will not come
            _best_effort(markers, ABANDONED, {"reason": f"rank 0 could not write its part: {_why(e)}"})
        raise
    if job.rank == 0:
        try:
            files = _collect(job, markers)
            _check_present(job, files)
            job.drill(job.step, "before_manifest")
            _commit(job, files)
        except Exception as e:
            _best_effort(markers, ABANDONED, {"reason": _why(e)})
            raise
        nbytes = sum(int(v["bytes"]) for v in files.values())
        clear_markers(job.exp)
        for p in manifest.prune(str(job.exp), job.keep):
            log.info("deleted old checkpoint %s", manifest.name_of(p))
        job.placement.after_commit()
    else:
        _wait_committed(job, markers)
        nbytes = sum(int(v["bytes"]) for v in mine.values())
    job.drill(job.step, "after_manifest")
    return AsyncResult(job.step, job.name, job.stall_s, time.perf_counter() - t0, nbytes)


def _write_own(job: AsyncJob) -> dict[str, dict[str, Any]]:
    """Steps 1 and 2: this rank's files written and durable (uploaded and checked on an object store)."""
    written = [path for path, _ in job.captured]
    for path, state in job.captured:
        job.write(state, path)
    job.captured = []  # the snapshot's views go; its buffers stay with HostCopy for the next save
    job.drill(job.step, "between_shards")
    rng.save(job.folder, job.rank, job.rng_state)
    own = [*written, *job.claimed, str(job.folder / rng.file_name(job.rank))]
    return job.placement.durable_own(job.folder, job.name, own)


def _collect(job: AsyncJob, markers: Location) -> dict[str, dict[str, Any]]:
    """Rank 0: every rank's entries once all markers are in (a rank's error or a timeout raises)."""
    seen: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + job.timeout_s
    while len(seen) < job.world:
        for rel, _ in markers.files() if markers.exists() else []:
            if not rel.startswith("rank") or not rel.endswith(".json"):
                continue
            r = int(rel[4:-5])
            if r in seen:
                continue
            m = markers.read_json(rel)
            if m.get("error"):
                raise RuntimeError(f"rank {r} could not write its part of {job.name}: {m['error']}")
            if "files" in m:
                seen[r] = m["files"]
        if len(seen) < job.world:
            if time.monotonic() > deadline:
                missing = sorted(set(range(job.world)) - set(seen))
                raise RuntimeError(f"{job.name}: ranks {missing} did not report their files within {job.timeout_s:.0f} "
                                   "s (resilience.collective_timeout_s); the checkpoint is not committed")
            time.sleep(job.poll_s)
    return {k: v for r in sorted(seen) for k, v in seen[r].items()}


def _check_present(job: AsyncJob, files: dict[str, dict[str, Any]]) -> None:
    """Every file a rank reported is in the checkpoint folder with the size it reported."""
    rels = list(files)
    sizes = dict(zip(rels, job.placement.stored(job.folder, job.name).sizes(rels)))
    wrong = [rel for rel, e in files.items() if sizes[rel] != int(e["bytes"])]
    if wrong:
        raise RuntimeError(f"{job.name}: {len(wrong)} reported file(s) missing or of another size, e.g. {wrong[:3]}")


def _commit(job: AsyncJob, files: dict[str, dict[str, Any]]) -> None:
    meta = {**(job.meta or {}), "save_id": job.save_id}
    job.placement.commit(job.folder, job.name, job.step, meta, files)


def _wait_committed(job: AsyncJob, markers: Location) -> None:
    """The other ranks: until rank 0's manifest for this save is there (or rank 0 gave up, or a timeout)."""
    where = job.exp.child(job.name)
    deadline = time.monotonic() + 2 * job.timeout_s
    while True:
        m = manifest.read_manifest(where)
        if m is not None and m.get("save_id") == job.save_id:
            return
        gave_up = markers.read_json(ABANDONED)
        if gave_up:
            raise RuntimeError(f"{job.name} was not committed: {gave_up.get('reason')}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{job.name}: no commit from rank 0 within {2 * job.timeout_s:.0f} s")
        time.sleep(job.poll_s)


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


def _best_effort(markers: Location, rel: str, obj: dict[str, Any]) -> None:
    """Tell the other ranks a save failed (they stop waiting for it)."""
    try:
        markers.write_json(rel, obj)
    except Exception as e:  # the error that got us here is the one to raise
        log.warning("could not report a failed checkpoint write: %s", e)


class BackgroundWriter:
    """The one background thread of a rank's saves: at most one in flight (`start` refuses while one runs; the
    manager waits for it first)."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._result: Any = None
        self._error: Optional[BaseException] = None

    @property
    def pending(self) -> bool:
        """A save was started and its outcome not collected by `wait` yet."""
        return self._thread is not None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, fn: Callable[[], Any]) -> None:
        if self.pending:
            raise RuntimeError("a checkpoint save is already in flight")
        self._result, self._error = None, None

        def body() -> None:
            try:
                self._result = fn()
            except BaseException as e:  # handed to the training thread by wait()
                self._error = e

        self._thread = threading.Thread(target=body, name="rayspeed-checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self) -> Any:
        """The outcome of the save in flight (None when there is none); its error is raised here."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"asynchronous checkpoint failed: {_why(err)}") from err
        return self._result
