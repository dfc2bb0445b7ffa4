"""The background half of an async save (rayspeed.checkpoint.async_save), two ranks as two threads (it never uses
a collective, so nothing else is needed): the manifest commits only after every rank's files are durable, a rank
dying between any two stages leaves the previous checkpoint or the new one (never a torn one that loads), at most
one save is in flight, and the host snapshot is what torch.save would have written."""

from __future__ import annotations

import collections
import hashlib
import io
import threading
import time
from pathlib import Path

import pytest
import torch

from rayspeed import storage
from rayspeed.checkpoint import async_save, manifest
from rayspeed.checkpoint.host_copy import HostCopy

STAGES = ("between_shards", "after_shards", "before_manifest", "after_manifest")


class Killed(BaseException):
    """A rank's process dying at a drill point: no marker, no cleanup, nothing after it."""


def _job(exp, step, rank, *, save_id, kill=None, timeout_s=1.5, events=None):
    name = manifest.dir_name(step)
    folder = manifest.saving_dir(exp.local, step)
    folder.mkdir(parents=True, exist_ok=True)
    shard = folder / "ds" / f"zero_pp_rank_{rank}_optim_states.pt"
    shard.parent.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "w": torch.full((64,), float(rank + step))}

    def drill(s, point):
        if events is not None:
            events.append((rank, point))
        if kill == (rank, point):
            raise Killed()

    return async_save.AsyncJob(step=step, name=name, save_id=save_id, rank=rank, world=2, exp=exp, folder=folder,
                               captured=[(str(shard), state)], write=lambda st, p: torch.save(st, p),
                               rng_state={"torch": torch.get_rng_state()},
                               meta={"world_size": 2} if rank == 0 else None, keep=2, timeout_s=timeout_s,
                               drill=drill, poll_s=0.02)


def _save(exp, step, kill=None, events=None, timeout_s=1.5):
    """Both ranks' background writes of checkpoint `step`, as threads; {rank: result or exception}."""
    save_id = f"save-{step}-{time.time_ns()}"
    out = {}

    def body(rank):
        try:
            out[rank] = async_save.run(_job(exp, step, rank, save_id=save_id, kill=kill, events=events,
                                            timeout_s=timeout_s))
        except BaseException as e:  # Killed, or the survivors' timeouts
            out[rank] = e

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_commit_after_every_rank_is_durable(tmp_path, monkeypatch):
    exp = storage.locate(str(tmp_path / "exp"))
    events = []
    real_durable, real_manifest = manifest.durable_entries, manifest.write_manifest

    def durable(d, rels):
        out = real_durable(d, rels)
        events.append((threading.current_thread().name, "durable"))
        return out

    def write_manifest(*a, **k):
        assert {n for n, e in events if e == "durable"} == {"rank0", "rank1"}, events  # both fsynced + hashed
        assert all((exp.local / async_save.MARKERS / manifest.dir_name(4) / f"rank{r}.json").exists() for r in (0, 1))
        events.append(("rank0", "manifest"))
        return real_manifest(*a, **k)

    monkeypatch.setattr(manifest, "durable_entries", durable)
    monkeypatch.setattr(manifest, "write_manifest", write_manifest)
    res = _save(exp, 4)
    assert all(isinstance(r, async_save.AsyncResult) for r in res.values()), res
    final = exp.local / manifest.dir_name(4)
    assert manifest.verify(final).ok
    m = manifest.read_manifest(final)
    assert set(m["files"]) == {"ds/zero_pp_rank_0_optim_states.pt", "ds/zero_pp_rank_1_optim_states.pt",
                               "rng_rank0.pt", "rng_rank1.pt"}
    assert m["save_id"].startswith("save-4-") and m["world_size"] == 2
    assert res[0].nbytes == sum(e["bytes"] for e in m["files"].values())  # rank 0: every rank's files
    assert not (exp.local / async_save.MARKERS).exists() and not manifest.saving_dir(exp.local, 4).exists()
    assert torch.equal(torch.load(final / "ds/zero_pp_rank_1_optim_states.pt")["w"], torch.full((64,), 5.0))


# (rank, point) -> the checkpoint the next start must load: a kill before the manifest on any rank (a rank other
# than 0 reports its part only after its before_manifest point) leaves step 2, a kill after it step 4.
EXPECTED = {(r, p): 2 for r in (0, 1) for p in ("between_shards", "after_shards", "before_manifest")}
EXPECTED.update({(0, "after_manifest"): 4, (1, "after_manifest"): 4})


@pytest.mark.parametrize("rank,point", sorted(EXPECTED))
def test_a_rank_dying_between_stages_leaves_the_previous_or_the_new_checkpoint(tmp_path, rank, point):
    exp = storage.locate(str(tmp_path / "exp"))
    first = _save(exp, 2)
    assert all(isinstance(r, async_save.AsyncResult) for r in first.values()), first
    res = _save(exp, 4, kill=(rank, point), timeout_s=0.5)
    assert isinstance(res[rank], Killed)
    newest, skipped = manifest.latest_verified(exp.local)
    assert manifest.step_of(newest) == EXPECTED[(rank, point)], (rank, point, skipped)
    for cand in manifest.candidates(exp.local):  # whatever is listed with a manifest verifies: nothing torn loads
        if manifest.read_manifest(cand) is not None:
            assert manifest.verify(cand).ok
    if EXPECTED[(rank, point)] == 2 and rank == 1:  # rank 0 gave up after its bounded wait, naming the rank
        assert "ranks [1] did not report" in str(res[0])


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failed_write_is_reported_and_never_committed(tmp_path, failing):
    exp = storage.locate(str(tmp_path / "exp"))
    save_id = "s"
    jobs = [_job(exp, 6, r, save_id=save_id, timeout_s=5) for r in (0, 1)]
    jobs[failing].write = lambda st, p: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    out = {}
    threads = [threading.Thread(target=lambda j=j: out.__setitem__(j.rank, _catch(async_save.run, j))) for j in jobs]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert time.monotonic() - t0 < 4  # the error marker ends the other rank's wait at once, not after the timeout
    other = 1 - failing
    assert "No space left" in str(out[failing])
    assert (f"rank {failing} could not write" if other == 0 else "was not committed: rank 0 could not write") \
        in str(out[other])
    assert manifest.latest_verified(exp.local)[0] is None


def _catch(fn, *a):
    try:
        return fn(*a)
    except Exception as e:
        return e


def test_one_save_in_flight():
    w = async_save.BackgroundWriter()
    gate = threading.Event()
    w.start(lambda: gate.wait(5) and "first")
    assert w.running and w.pending
    with pytest.raises(RuntimeError, match="already in flight"):
        w.start(lambda: "second")
    gate.set()
    assert w.wait() == "first" and not w.pending
    w.start(lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="asynchronous checkpoint failed: ZeroDivisionError"):
        w.wait()


def _serialized(obj) -> str:
    b = io.BytesIO()
    torch.save(obj, b)
    return hashlib.sha256(b.getvalue()).hexdigest()


def test_host_copy_writes_the_same_bytes_and_is_isolated_from_training():
    flat = torch.randn(1000)
    sd = collections.OrderedDict(a=flat[:10], b=flat[10:30].view(4, 5), c=torch.randn(3, requires_grad=True))
    sd._metadata = {"": {"version": 1}}
    shared = [flat[500:510], 3, "x"]
    state = {"module": sd, "optimizer": {"p": torch.nn.Parameter(torch.randn(4)), "lst": shared, "again": shared,
                                         "t": (1, flat), "step": 7}, "alias": sd}
    before = _serialized(state)
    host = HostCopy()
    host.begin()
    snap = host.copy(state)
    host.end()
    assert _serialized(snap) == before  # the bytes a synchronous save writes
    assert snap["optimizer"]["lst"] is snap["optimizer"]["again"] and snap["alias"] is snap["module"]
    assert snap["module"]["b"].untyped_storage().data_ptr() == snap["module"]["a"].untyped_storage().data_ptr()
    assert host.nbytes == 1000 * 4 + 3 * 4 + 4 * 4  # each storage once, whole
    flat.add_(1.0)  # training goes on
    assert _serialized(snap) == before
    buffers = [s.data_ptr() for s in host._pool]
    host.begin()
    again = host.copy(state)
    host.end()
    assert [s.data_ptr() for s in host._pool] == buffers  # the next snapshot reuses the host buffers
    assert _serialized(again) == _serialized(state) != before


def test_markers_live_outside_checkpoints(tmp_path):
    exp = storage.locate(str(tmp_path))
    d = async_save.marker_dir(exp, manifest.dir_name(8))
    d.write_json("rank0.json", {"files": {}})
    assert manifest.candidates(tmp_path) == []  # never a checkpoint candidate
    async_save.clear_markers(exp)
    assert not Path(d.uri).exists()
