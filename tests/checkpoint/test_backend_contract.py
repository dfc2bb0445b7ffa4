"""The checkpoint protocol over every kind of location (rayspeed.storage: local disk, an object store through moto's
S3 server, memory://), with a small engine state of plain tensors behind the EngineState interface: a location reads,
writes, lists and deletes as the protocol needs; a checkpoint commits with a sha256 manifest that catches a changed
byte; the newest verified checkpoint is chosen and a torn or uncommitted one is skipped; retention deletes old ones
and never a newer one being written; the manager saves (sync and async) and resumes through the same calls.

A new kind of location joins the protocol by its entry in LOCATIONS."""

from __future__ import annotations

import hashlib
import logging
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rayspeed import storage
from rayspeed.checkpoint import manager, manifest, resume, rng
from rayspeed.checkpoint.manager import CheckpointManager
from rayspeed.checkpoint.placement import placement_for
from rayspeed.config import parse
from rayspeed.engine.engine_state import EngineState


def _local(tmp_path, request):
    return str(tmp_path / "runs" / "job")


def _s3(tmp_path, request):
    return f"s3://{request.getfixturevalue('s3').bucket()}/runs/job"


def _memory(tmp_path, request):
    return f"memory://{uuid.uuid4().hex[:8]}/runs/job"


LOCATIONS = {"local": _local, "s3": _s3, "memory": _memory}


@pytest.fixture(params=list(LOCATIONS))
def exp_dir(request, tmp_path):
    """A fresh experiment folder on one kind of location, as the path callers pass around."""
    return LOCATIONS[request.param](tmp_path, request)


class TensorState:
    """An engine state of plain tensors: one file per rank, written with torch.save (the EngineState interface)."""

    def __init__(self, n: int = 256, value: float = 0.0, rank: int = 0):
        self.w = torch.full((n,), value)
        self.file = f"state/rank{rank}.pt"

    def save(self, folder, client_state):
        for path, state in self.capture(folder, client_state, lambda s: s):
            torch.save(state, path)

    def load(self, folder, *, universal=False, module_only=False):
        state = torch.load(Path(folder) / self.file, weights_only=False)
        self.w = state.pop("w")
        return state

    def capture(self, folder, client_state, copy):
        (Path(folder) / "state").mkdir(parents=True, exist_ok=True)
        return [(str(Path(folder) / self.file), copy({"w": self.w.clone(), **client_state}))]

    def writer(self):
        return lambda state, path: torch.save(state, path)

    def async_problem(self):
        return None

    def versions(self):
        return {}


def _ctx(exp_dir, rank=0, world=1):
    return SimpleNamespace(rank=rank, world_size=world, local_rank=rank, node_id="node-a", experiment_dir=exp_dir,
                           is_rank0=rank == 0, under_ray=False)


def _commit(exp_dir, step, tmp_path, commit=True, value=None):
    """Checkpoint `step` written through the protocol's placement (one rank): its files, durable, then the manifest."""
    exp, ctx = storage.locate(exp_dir), _ctx(exp_dir)
    where = placement_for(exp, tmp_path / "staging" / "node-a")
    d = where.fresh_folder(step, ctx)
    TensorState(value=float(step if value is None else value)).save(d, {"step": step})
    rng.save(d, 0)
    files = where.durable_share(d, ctx)
    if commit:
        where.commit(d, manifest.dir_name(step), step, {"world_size": 1}, files)
        where.after_commit()
    elif exp.is_local:  # a save that died before its commit leaves its files where it wrote them
        exp.upload_dir(d, manifest.dir_name(step))
    return str(exp.child(manifest.dir_name(step)))


def test_the_location_reads_writes_lists_and_deletes(exp_dir, tmp_path):
    loc = storage.locate(exp_dir)
    assert isinstance(storage.locate(str(loc)), type(loc)) and loc.name == "job"
    assert loc.read_bytes("nothing") is None and loc.read_json("nothing.json") == {} and not loc.exists("nothing")
    assert loc.size("nothing") is None and loc.files() == [] and loc.subdirs() == []
    loc.mkdirs()
    loc.write_bytes("a/b.bin", b"\x00\x01" * 10)
    loc.write_text("a/c.txt", "hello")
    loc.write_json("summary.json", {"status": "finished"})
    loc.commit("a/manifest.json", b"{}")
    assert loc.read_bytes("a/b.bin") == b"\x00\x01" * 10 and loc.read_text("a/c.txt") == "hello"
    assert loc.read_json("summary.json") == {"status": "finished"}
    assert loc.child("a").read_bytes("manifest.json") == b"{}"
    assert loc.exists("a") and loc.exists("a/b.bin") and loc.size("a/b.bin") == 20
    assert loc.sizes(["a/b.bin", "a/none"]) == [20, None]
    assert loc.files() == [("a/b.bin", 20), ("a/c.txt", 5), ("a/manifest.json", 2), ("summary.json", 26)]
    assert loc.subdirs() == ["a"]
    with loc.open_input("a/b.bin") as fh:
        assert fh.read(3) == b"\x00\x01\x00"
    assert loc.sha256("a/b.bin") == hashlib.sha256(b"\x00\x01" * 10).hexdigest()
    loc.append_jsonl("events.jsonl", {"kind": "failure"})
    loc.append_jsonl("events.jsonl", {"kind": "resize"})
    assert [e["kind"] for e in loc.read_jsonl("events.jsonl")] == ["failure", "resize"]
    src = tmp_path / "up"
    (src / "ds").mkdir(parents=True)
    (src / "ds" / "x.pt").write_bytes(b"x" * 7)
    (src / "y.pt").write_bytes(b"y")
    assert loc.upload_dir(src, "ckpt") == ["ds/x.pt", "y.pt"]
    back = loc.download_dir("ckpt", tmp_path / "down")
    assert (back / "ds" / "x.pt").read_bytes() == b"x" * 7 and (back / "y.pt").read_bytes() == b"y"
    loc.delete("a/c.txt")
    assert not loc.exists("a/c.txt") and loc.exists("a/b.bin")
    loc.delete("a")
    loc.delete("nothing")  # nothing there is not an error
    assert not loc.exists("a") and sorted(loc.subdirs()) == ["ckpt"]
    assert not [rel for rel, _ in loc.files() if rel.endswith(".tmp")]  # no temporary left behind


def test_a_commit_writes_a_sha256_manifest_that_catches_a_changed_byte(exp_dir, tmp_path):
    d = _commit(exp_dir, 10, tmp_path)
    m = manifest.read_manifest(d)
    assert m["step"] == 10 and m["format"] == manifest.FORMAT_VERSION and m["world_size"] == 1
    assert sorted(m["files"]) == ["rng_rank0.pt", "state/rank0.pt"]
    loc = storage.locate(d)
    for rel, e in m["files"].items():
        assert e == {"bytes": loc.size(rel), "sha256": hashlib.sha256(loc.read_bytes(rel)).hexdigest()}
    assert manifest.verify(d).ok and not loc.exists(manifest.MANIFEST + ".tmp")
    data = bytearray(loc.read_bytes("state/rank0.pt"))
    data[-1] ^= 1
    loc.write_bytes("state/rank0.pt", bytes(data))
    assert manifest.verify(d, deep=False).ok  # same size: only the hash can tell
    assert "does not match its sha256" in manifest.verify(d).reason
    loc.delete("rng_rank0.pt")
    assert "rng_rank0.pt is missing" in manifest.verify(d, deep=False).reason


def test_the_newest_verified_checkpoint_is_chosen_and_a_torn_one_skipped(exp_dir, tmp_path):
    _commit(exp_dir, 5, tmp_path)
    newest = _commit(exp_dir, 10, tmp_path)
    _commit(exp_dir, 15, tmp_path, commit=False)  # shards without a manifest: the writer died
    torn = _commit(exp_dir, 20, tmp_path)
    storage.locate(torn).write_bytes(manifest.MANIFEST, b'{"step": 20, "fil')  # a manifest cut short
    assert [manifest.step_of(p) for p in manifest.candidates(exp_dir)] == [20, 15, 10, 5]
    found, skipped = manifest.latest_verified(exp_dir)
    assert str(found) == newest and len(skipped) == 2
    assert all("no readable manifest" in s for s in skipped)
    assert str(resume.choose(exp_dir)) == newest
    assert str(resume.choose(exp_dir, deep=False)) == newest


def test_retention_deletes_old_checkpoints_and_spares_a_newer_partial_one(exp_dir, tmp_path):
    for s in (5, 10, 15, 20):
        _commit(exp_dir, s, tmp_path)
    _commit(exp_dir, 25, tmp_path, commit=False)  # being written right now
    _commit(exp_dir, 12, tmp_path, commit=False)  # an old partial write
    removed = sorted(manifest.step_of(p) for p in manifest.prune(exp_dir, keep=2))
    assert removed == [5, 10, 12]
    assert [manifest.step_of(p) for p in manifest.candidates(exp_dir)] == [25, 20, 15]
    assert manifest.latest_verified(exp_dir)[0] is not None


def _manager(tmp_path, exp_dir, mode, chosen=None, meta=None):
    from rayspeed.planner import resolve

    cfg, _ = resolve(parse({"name": "job", "resilience": {"checkpoint_mode": mode, "checkpoint_every_steps": 2,
                                                          "keep_checkpoints": 2},
                            "storage": {"staging_dir": str(tmp_path / "staging")}, "cluster": {"num_workers": 1}}),
                     world_size=1)
    plan = {"snapshot_bytes_per_rank": 1 << 30, "snapshot_bytes_per_node": 1 << 30}
    return CheckpointManager(cfg, _ctx(exp_dir), chosen, meta, run_id="run", snapshot_plan=plan)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_manager_saves_and_resumes_through_the_interfaces(exp_dir, tmp_path, mode, monkeypatch):
    monkeypatch.setattr(manager, "host_available_bytes", lambda: 64 << 30)
    state = TensorState()
    assert isinstance(state, EngineState)
    ckpt = _manager(tmp_path, exp_dir, mode)
    for step in (2, 4, 6):
        state.w.add_(1.0)
        assert ckpt.should_save(step)
        ckpt.save(step, state, {"step": step, "data": {"position": step * 8}})
        ckpt.poll()
    ckpt.drain()
    assert ckpt.mode == mode and ckpt.last_bytes and len(ckpt.writes) == 3
    assert [manifest.step_of(p) for p in manifest.candidates(exp_dir)] == [6, 4]  # keep_checkpoints: 2
    assert not [rel for rel, _ in storage.locate(exp_dir).files() if ".checkpoint_done" in rel]
    chosen, meta = manager.choose(_ctx(exp_dir))
    assert manifest.step_of(chosen) == 6 and meta["step"] == 6 and meta["versions"]["torch"] == torch.__version__
    fresh = TensorState()
    again = _manager(tmp_path, exp_dir, mode, chosen, meta)
    assert again.prepare({"zero_optimization": {"stage": 0}}) == {"zero_optimization": {"stage": 0}}
    client = again.load(fresh)
    assert client["step"] == 6 and client["data"] == {"position": 48} and client["mlflow_run_id"] == "run"
    assert torch.equal(fresh.w, torch.full((256,), 3.0))
    assert not list((tmp_path / "staging").rglob("*.pt"))  # a staged copy goes once it is loaded


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def _two_ranks_save(rank, world_size, exp_dir, tmp):
    """Each rank of a gloo world saves its TensorState through the manager (sync: every barrier is real here)."""
    from rayspeed.planner import resolve

    cfg, _ = resolve(parse({"name": "job", "resilience": {"checkpoint_mode": "sync", "checkpoint_every_steps": 2},
                            "storage": {"staging_dir": str(Path(tmp) / "staging")}, "cluster": {"num_workers": 2}}),
                     world_size=2)
    ctx = _ctx(exp_dir, rank, world_size)
    ckpt = CheckpointManager(cfg, ctx, run_id="run")
    state = TensorState(value=float(rank), rank=rank)
    ckpt.save(2, state, {"step": 2})
    chosen, meta = manager.choose(ctx)
    again = CheckpointManager(cfg, ctx, chosen, meta, run_id="run")
    again.prepare({})
    fresh = TensorState(rank=rank)
    client = again.load(fresh)
    return {"chosen": chosen, "files": sorted(meta["files"]), "step": client["step"], "w": float(fresh.w[0])}


@pytest.mark.parametrize("kind", ["local", "s3"])  # memory:// is one process's: not shared by two ranks
def test_two_ranks_commit_one_checkpoint_and_resume_it(kind, tmp_path, request):
    from _dist import run_distributed

    exp_dir = LOCATIONS[kind](tmp_path, request)
    r0, r1 = run_distributed(_two_ranks_save, 2, exp_dir, str(tmp_path), timeout_s=120)
    assert r0["chosen"] == r1["chosen"] and manifest.step_of(r0["chosen"]) == 2
    assert r0["files"] == ["rng_rank0.pt", "rng_rank1.pt", "state/rank0.pt", "state/rank1.pt"]
    assert r0["step"] == r1["step"] == 2 and (r0["w"], r1["w"]) == (0.0, 1.0) and manifest.verify(r0["chosen"]).ok
