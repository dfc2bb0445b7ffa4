"""CheckpointManager's asynchronous saves, world size 1 in this process with a stand-in engine that writes through
DeepSpeed's TorchCheckpointEngine like DeepSpeedEngine.save_checkpoint does: one save in flight (the next waits,
and the wait is stall), the one-line fall back to sync when the snapshot does not fit host memory, the planner's
snapshot estimate, and async saves to an object store (moto S3) whose staging copy goes only after the upload
verified."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rayspeed import compat, storage
from rayspeed.checkpoint import async_save, manager, manifest, staging
from rayspeed.checkpoint.manager import CheckpointManager
from rayspeed.config import parse


class StandInEngine:
    """The part of DeepSpeedEngine a save touches: checkpoint_engine.makedirs/create/save/commit."""

    def __init__(self, n: int = 4096):
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        self.checkpoint_engine = TorchCheckpointEngine()
        self.w = torch.zeros(n)

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        ce = self.checkpoint_engine
        ce.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        ce.create(None)
        ce.save({"module": {"w": self.w}, **(client_state or {})},
                os.path.join(save_dir, tag, "mp_rank_00_model_states.pt"))
        ce.commit(None)

    def step(self):
        self.w.add_(1.0)


def _manager(tmp_path, exp_dir, mode="async", plan=None):
    from rayspeed.planner import resolve

    cfg, _ = resolve(parse({"name": "job", "resilience": {"checkpoint_mode": mode, "checkpoint_every_steps": 2},
                            "storage": {"staging_dir": str(tmp_path / "staging")}, "cluster": {"num_workers": 1}}),
                     world_size=1)
    ctx = SimpleNamespace(rank=0, world_size=1, local_rank=0, node_id="node-a", experiment_dir=exp_dir,
                          is_rank0=True, under_ray=False)
    plan = plan or {"snapshot_bytes_per_rank": 1 << 30, "snapshot_bytes_per_node": 1 << 30}
    return CheckpointManager(cfg, ctx, run_id="run", snapshot_plan=plan)


def test_one_save_in_flight_and_the_wait_is_stall(tmp_path, monkeypatch):
    engine = StandInEngine()
    ckpt = _manager(tmp_path, str(tmp_path / "exp"))
    monkeypatch.setattr(manager, "host_available_bytes", lambda: 64 << 30)
    active, most = [0], [0]
    real = compat.checkpoint_writer

    def slow_writer(eng):
        write = real(eng)

        def w(state, path):
            active[0] += 1
            most[0] = max(most[0], active[0])
            time.sleep(1.0)
            write(state, path)
            active[0] -= 1
        return w

    monkeypatch.setattr(compat, "checkpoint_writer", slow_writer)
    first = ckpt.save(2, engine, {"step": 2})
    assert ckpt.mode == "async" and first < 0.5  # training stopped only for the snapshot
    engine.step()  # the next steps change the live state while the write runs
    assert ckpt.poll() == []  # still writing
    second = ckpt.save(4, engine, {"step": 4})
    assert second >= 0.7  # waited for the save in flight: that wait is stall
    assert most[0] == 1
    ckpt.drain()
    records = ckpt.poll()
    assert [r["step"] for r in records] == [2, 4] and all(r["write_s"] >= 1.0 for r in records)
    root = tmp_path / "exp"
    for step, value in ((2, 0.0), (4, 1.0)):
        d = root / manifest.dir_name(step)
        assert manifest.verify(d).ok
        state = torch.load(d / "ds" / "mp_rank_00_model_states.pt", weights_only=False)
        assert state["step"] == step and torch.equal(state["module"]["w"], torch.full((4096,), value))
    assert ckpt.median_stall() == max(first, second) and ckpt.last_bytes == records[-1]["bytes"]


def test_falls_back_to_sync_when_the_snapshot_does_not_fit(tmp_path, monkeypatch, caplog):
    engine = StandInEngine()
    ctx = SimpleNamespace(rank=0, world_size=1, node_id="node-a")
    plan = {"snapshot_bytes_per_rank": 20 << 30, "snapshot_bytes_per_node": 40 << 30}
    monkeypatch.setattr(manager, "host_available_bytes", lambda: 16 << 30)
    with caplog.at_level(logging.INFO, logger="rayspeed.checkpoint"):
        assert manager.checkpoint_mode("async", ctx, engine, plan) == "sync"
    lines = [r.getMessage() for r in caplog.records if "checkpoint_mode" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("checkpoints: resilience.checkpoint_mode async -> sync: the "
                                                   "snapshot of an async save needs 40.00 GiB of host memory per node")
    assert caplog.records[-1].levelno == logging.WARNING
    monkeypatch.setattr(manager, "host_available_bytes", lambda: 256 << 30)
    assert manager.checkpoint_mode("auto", ctx, engine, plan) == "async"
    small = {"snapshot_bytes_per_rank": 1 << 20, "snapshot_bytes_per_node": 1 << 20}
    assert manager.checkpoint_mode("auto", ctx, engine, small) == "sync"  # auto: too small to pay
    assert manager.checkpoint_mode("async", ctx, engine, small) == "async"
    assert manager.checkpoint_mode("sync", ctx, engine, plan) == "sync"
    engine.checkpoint_engine = object()  # a decoupled/other engine writes on its own: never captured
    assert manager.checkpoint_mode("async", ctx, engine, plan) == "sync"


def test_the_plan_reports_the_snapshot_and_the_mode():
    from rayspeed.planner import plan_job
    from rayspeed.planner.checkpoint_memory import choose_mode

    cfg = parse({"name": "big", "model": {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "vocab_size": 32000,
                                          "seq_len": 2048},
                 "train": {"global_batch_size": 256}, "cluster": {"num_workers": 16, "use_gpu": True,
                                                                   "gpu": "h100-sxm-80gb", "gpus_per_node": 8}})
    res = plan_job(cfg)
    ck = res.best["checkpoint"]
    lay = res.layout
    assert ck["mode_requested"] == "auto" and ck["mode"] == "async", ck
    # ~6.7B parameters: 16 bytes each on the whole, split by ZeRO over dp
    total = ck["snapshot_bytes_per_node"] * (16 // 8)
    assert 0.5 * 6.7e9 * 16 / lay.tp / lay.pp < total <= 2 * 6.7e9 * 16, ck
    assert "checkpoints:" in res.explain and "snapshot (async)" in res.explain
    assert choose_mode("auto", 1 << 30, 900 << 30, 800 << 30)[0] == "sync"


def test_async_on_s3_deletes_staging_only_after_the_upload_verified(s3, tmp_path, monkeypatch):
    bucket = s3.bucket()
    exp_uri = f"s3://{bucket}/runs/job"
    engine = StandInEngine(n=1 << 16)
    ckpt = _manager(tmp_path, exp_uri)
    monkeypatch.setattr(manager, "host_available_bytes", lambda: 64 << 30)
    exp = storage.locate(exp_uri)
    seen = []
    real_rmtree = shutil.rmtree

    def rmtree(path, *a, **k):
        p = str(path)
        if "/save/rank0/checkpoint_step" in p:  # the staging copy of a save: the store must hold every file by now
            stored = dict(exp.child(os.path.basename(p)).files())
            local = {str(f.relative_to(path)): f.stat().st_size for f in Path(p).rglob("*") if f.is_file()}
            ok = bool(local) and all(stored.get(r) == s for r, s in local.items())
            seen.append((threading.current_thread().name, p, ok))
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    ckpt.save(5, engine, {"step": 5})
    engine.step()
    ckpt.save(10, engine, {"step": 10})
    ckpt.drain()
    uploads = [s for s in seen if s[0] == "rayspeed-checkpoint-writer"]
    assert len(uploads) == 2 and all(ok for _, _, ok in uploads), seen
    keys = s3.keys(bucket, "runs/job/")
    assert "runs/job/checkpoint_step00000010/manifest.json" in keys and not [k for k in keys if MARKER in k], keys
    assert manifest.verify(exp_uri + "/checkpoint_step00000010").ok
    assert not list((tmp_path / "staging").rglob("*.pt"))
    node = staging.node_dir(tmp_path / "staging", "job", "node-a")
    local = staging.fetch(exp, "checkpoint_step00000010", node)
    state = torch.load(local / "ds" / "mp_rank_00_model_states.pt", weights_only=False)
    assert state["step"] == 10 and torch.equal(state["module"]["w"], torch.ones(1 << 16))


MARKER = async_save.MARKERS


@pytest.fixture(autouse=True)
def _quiet_deepspeed():
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
