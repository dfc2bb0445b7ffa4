"""The checkpoint manager: which checkpoint a (re)started attempt resumes from, its staging from an object store,
the universal conversion after a layout change, loading, saving under the manifest protocol, RNG, retention and
the watchdog's rollback. It hands the trainer the client state it saved (step, data position, restarts) instead
of reaching into the trainer.

    chosen, meta = choose(ctx)                                # collective: rank 0 picks, everyone agrees
    ckpt = CheckpointManager(cfg, ctx, chosen, meta, run_id, chaos)
    ds_config = ckpt.prepare(ds_config)                       # converts to universal when the layout changed
    client = ckpt.load(engine)                                # {"step", "data", "restarts"} or None
    if ckpt.should_save(step): stall = ckpt.save(step, engine, client_state)
    for record in ckpt.poll(): ...                            # saves finished since (write time, bytes), each step
    ckpt.drain()                                              # at the end: the save in flight commits

Saving is synchronous or asynchronous (resilience.checkpoint_mode, decided at the first save: `mode`). An async
save stops training only for a host snapshot of what the engine would write (engine_state.EngineState.capture,
host_copy.HostCopy); async_save.run writes, makes durable and commits it on a background thread, one in flight.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import torch

from rayspeed import paths, storage
from rayspeed.checkpoint import async_save, manifest, resume, rng, staging
from rayspeed.checkpoint.consolidate import manifest_model_meta
from rayspeed.checkpoint.host_copy import HostCopy
from rayspeed.checkpoint.placement import placement_for
from rayspeed.config.layout import Layout
from rayspeed.config.load import to_dict
from rayspeed.config.schema import JobConfig
from rayspeed.engine.deepspeed_state import with_universal_load
from rayspeed.engine.engine_state import as_engine_state
from rayspeed.logs import log_rank
from rayspeed.parallel.objects import barrier, broadcast_object, gather_objects
from rayspeed.planner.checkpoint_memory import HOST_FRACTION, choose_mode

log = logging.getLogger("rayspeed.checkpoint")


def choose(ctx: Any) -> tuple[Optional[str], Optional[dict[str, Any]]]:
    """The checkpoint this attempt resumes from and its manifest (None, None: a fresh start). A collective: rank 0
    picks the newest verified checkpoint and every rank gets its choice.

    The manifests are the only index of checkpoints: none is reported to Ray Train, whose run snapshot would
    otherwise name folders that retention deletes and refuse the next submission (rayspeed.train.launch)."""
    where = placement_for(storage.locate(ctx.experiment_dir))
    chosen = None
    if ctx.is_rank0:
        found = resume.choose(ctx.experiment_dir, deep=where.deep_verify)
        chosen = str(found) if found else None
    chosen = broadcast_object(chosen)
    return chosen, (manifest.read_manifest(chosen) if chosen else None)


def config_hash(cfg: JobConfig) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


class CheckpointManager:
    def __init__(self, cfg: JobConfig, ctx: Any, chosen: Optional[str] = None, meta: Optional[dict[str, Any]] = None,
                 run_id: Optional[str] = None, chaos: Any = None, identity: Optional[dict[str, Any]] = None,
                 snapshot_plan: Optional[dict[str, Any]] = None):
        self.cfg, self.ctx, self.run_id, self.chaos = cfg, ctx, run_id, chaos
        self.snapshot_plan = snapshot_plan  # the plan's `checkpoint` object (planner.checkpoint_memory)
        self.identity = identity  # what the run computes, as submitted (rayspeed.train.resume_guard)
        self.chosen, self.meta = chosen, meta
        self.exp = storage.locate(ctx.experiment_dir)
        # Node-local staging, used only when the experiment lives on an object store.
        self.stage = staging.node_dir(paths.staging_root(cfg.storage.staging_dir), cfg.name, ctx.node_id)
        self.placement = placement_for(self.exp, self.stage)
        self.every = cfg.resilience.checkpoint_every_steps
        self._local: Optional[str] = None  # the chosen checkpoint as a local folder (staged when remote)
        self._universal = False  # the chosen checkpoint was converted for this layout
        self._module_only = False
        self.stalls: list[float] = []
        self.writes: list[float] = []
        self.last_bytes: Optional[int] = None
        self.mode: Optional[str] = None  # sync | async, decided at the first save
        self._host = HostCopy()
        self._writer = async_save.BackgroundWriter()
        self._finished: list[dict[str, Any]] = []  # for the reporter (poll)
        self._overlap = 0  # steps run while the save in flight was being written

    # ------------------------------------------------------------------ loading
    def prepare(self, ds_config: dict[str, Any]) -> dict[str, Any]:
        """Stage the chosen checkpoint (object stores) and convert it to a universal checkpoint when its ZeRO
        partitions were written for another layout; returns the DeepSpeed config to build the engine with."""
        if not self.chosen:
            return ds_config
        self._local = self.placement.local_copy(self.chosen, self.ctx)
        now = Layout.from_parallel(self.cfg.parallel).partition()
        old_zero = int(((self.meta or {}).get("layout") or {}).get("zero_stage", 0))
        resume.refuse_expert_conversion(self.meta or {}, now, manifest.name_of(self.chosen))
        if old_zero == 0 and now["zero_stage"] > 0:
            # A ZeRO-0 checkpoint holds whole weights and a plain optimizer state dict, not the partitions the
            # universal converter reads: the weights carry over, the optimizer state starts again.
            self._module_only = True
            log_rank(log, "resume: the checkpoint is ZeRO-0 and this world runs ZeRO-%d (the pinned stage does not "
                     "fit): weights restored, optimizer state restarts", now["zero_stage"], level=logging.WARNING)
        elif resume.needs_universal(self.meta or {}, now):
            if self.placement.converts(self.ctx):
                log.info("layout changed %s -> %s: converting %s to a universal checkpoint",
                         (self.meta or {}).get("layout"), now, manifest.name_of(self.chosen))
                resume.convert_to_universal(self._local)
            else:  # bounded polling of the converter's markers, never a collective under the group's timeout
                resume.wait_converted(self._local, self.cfg.resilience.conversion_timeout_s)
            self._universal = True
            ds_config = with_universal_load(ds_config)
        return ds_config

    def load(self, engine: Any) -> Optional[dict[str, Any]]:
        """Load the prepared checkpoint into the engine; the client state it was saved with (None: fresh start)."""
        if not self.chosen:
            return None
        path = self._local
        assert path is not None, "load() after prepare(), which stages the chosen checkpoint"
        full = not self._module_only
        client = as_engine_state(engine).load(Path(path), universal=self._universal, module_only=not full)
        if client is None:
            kind = "universal" if self._universal else "saved"
            raise RuntimeError(f"the engine could not load {path} (its {kind} state)")
        if (self.meta or {}).get("world_size") == self.ctx.world_size:
            rng.load(Path(path), self.ctx.rank)
        self.placement.release(path, self.ctx)
        log_rank(log, "resumed from %s at step %d (restart %d, world %s -> %d)", manifest.name_of(self.chosen),
                 int(client["step"]), int(client.get("restarts", 0)) + 1, (self.meta or {}).get("world_size"),
                 self.ctx.world_size)
        return client

    # ------------------------------------------------------------------ saving
    def should_save(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.cfg.train.max_steps

    def save(self, step: int, engine: Any, client: dict[str, Any]) -> float:
        """Save checkpoint `step` (every rank); returns the stall: how long training was blocked."""
        if self._choose_mode(engine) == "async":
            return self._save_async(step, engine, client)
        stall, nbytes = self._save_sync(step, engine, client)
        self.writes.append(stall)
        self._finished.append({"step": step, "stall_s": stall, "write_s": stall, "bytes": nbytes})
        return stall

    def _save_sync(self, step: int, engine: Any, client: dict[str, Any]) -> tuple[float, int]:
        """Commit protocol (rayspeed.checkpoint.manifest): shards into a fresh folder, each rank fsyncs and hashes
        its share, then one manifest and (local storage) the rename that commits. Returns (stall, bytes)."""
        t0 = time.perf_counter()
        exp, name, where = self.exp, manifest.dir_name(step), self.placement
        self._drill(step, "before_shards")
        d = where.fresh_folder(step, self.ctx)
        barrier()
        state = as_engine_state(engine)
        state.save(d, self._client(client))
        self._drill(step, "between_shards")
        rng.save(d, self.ctx.rank)
        mine = where.durable_share(d, self.ctx)
        self._drill(step, "after_shards")
        files = {k: v for part in gather_objects(mine) for k, v in part.items()}  # every rank's part is done
        self._drill(step, "before_manifest")
        barrier()  # the manifest commits only while every rank is alive past its shards
        if self.ctx.is_rank0:
            where.commit(d, name, step, self._meta(state), files)
        barrier()
        self._drill(step, "after_manifest")
        if self.ctx.is_rank0:
            for p in manifest.prune(str(exp), self.cfg.resilience.keep_checkpoints):
                log.info("deleted old checkpoint %s", manifest.name_of(p))
            where.after_commit()
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        self.last_bytes = sum(int(v["bytes"]) for v in files.values())
        return stall, self.last_bytes

    def _client(self, client: dict[str, Any]) -> dict[str, Any]:
        return {**client, "mlflow_run_id": self.run_id}

    # ------------------------------------------------------------------ asynchronous saving
    def _save_async(self, step: int, engine: Any, client: dict[str, Any]) -> float:
        """Training waits for the save in flight (if any), then only for the snapshot; async_save.run writes,
        makes durable and commits in the background."""
        t0 = time.perf_counter()
        self.drain()  # at most one save in flight: this wait is stall
        self._drill(step, "before_shards")
        exp, name, rank0, state = self.exp, manifest.dir_name(step), self.ctx.is_rank0, as_engine_state(engine)
        d = self.placement.fresh_folder(step, self.ctx)
        if rank0:
            async_save.clear_markers(exp, name)  # a crashed earlier save of the same step
        save_id = broadcast_object(uuid.uuid4().hex if rank0 else None)  # also the barrier: the folder exists
        self._host.begin()
        try:
            captured = state.capture(d, self._client(client), self._host.copy)
        finally:
            self._host.end()
        claimed = self.placement.claimed(d, rank0)
        job = async_save.AsyncJob(
            step=step, name=name, save_id=save_id, rank=self.ctx.rank, world=self.ctx.world_size, exp=exp, folder=d,
            captured=captured, write=state.writer(), rng_state=rng.state(), claimed=claimed,
            meta=self._meta(state) if rank0 else None, keep=self.cfg.resilience.keep_checkpoints,
            timeout_s=self.cfg.resilience.collective_timeout_s, drill=self._drill, poll_s=self.placement.poll_s,
            placement=self.placement)
        job.stall_s = stall = time.perf_counter() - t0
        self._overlap = 0
        self._writer.start(lambda: async_save.run(job))
        self.stalls.append(stall)
        return stall

    def _choose_mode(self, engine: Any) -> str:
        if self.mode is None:
            self.mode = checkpoint_mode(self.cfg.resilience.checkpoint_mode, self.ctx, engine, self.snapshot_plan)
        return self.mode

    def poll(self) -> list[dict[str, Any]]:
        """Once per step: the saves finished since the last call ({step, stall_s, write_s, bytes}; a sync save at
        once, an async one when its background write committed). Counts the steps run meanwhile; raises the error
        of a failed background write."""
        if self._writer.running:
            self._overlap += 1
        elif self._writer.pending:
            self._collect()
        out, self._finished = self._finished, []
        return out

    def drain(self) -> None:
        """Wait for the save in flight (the start of a save, a rollback, the end)."""
        if self._writer.pending:
            self._collect()

    def _collect(self) -> None:
        res = self._writer.wait()  # raises the background write's error
        if res is None:
            return
        self.writes.append(res.write_s)
        self.last_bytes = res.nbytes
        self._finished.append({"step": res.step, "stall_s": res.stall_s, "write_s": res.write_s, "bytes": res.nbytes,
                               "steps_during_write": self._overlap})
        log_rank(log, "%s committed: training stalled %.2f s, written in the background in %.1f s while %d steps "
                 "ran, %.2f GB", res.name, res.stall_s, res.write_s, self._overlap, res.nbytes / 1e9)

    def _drill(self, step: int, point: str) -> None:
        if self.chaos is not None:
            self.chaos.in_checkpoint(step, point)

    def _meta(self, state: Any) -> dict[str, Any]:
        c = self.cfg
        return {
            "job": c.name,
            "world_size": self.ctx.world_size,
            "layout": Layout.from_parallel(c.parallel).record(),
            "global_batch_size": c.train.global_batch_size,
            "versions": {"torch": torch.__version__, **state.versions()},
            "config_hash": config_hash(c),
            "run_identity": self.identity,
            **manifest_model_meta(c),  # lets `rayspeed export <checkpoint dir>` rebuild the model on its own
        }

    def median_stall(self) -> Optional[float]:
        return _median(self.stalls)

    def median_write(self) -> Optional[float]:
        return _median(self.writes)

    # ------------------------------------------------------------------ rollback
    def rollback(self, engine: Any) -> Optional[str]:
        """Restore the newest verified checkpoint into the engine in place (the watchdog's remedy); its name, or
        None when there is nothing to restore."""
        self.drain()  # the save in flight commits first: it may be the newest verified one
        chosen = None
        if self.ctx.is_rank0:
            found, _ = manifest.latest_verified(self.ctx.experiment_dir, deep=self.placement.deep_verify)
            chosen = str(found) if found else None
        chosen = broadcast_object(chosen)
        if chosen is None:
            return None
        local = self.placement.local_copy(chosen, self.ctx)
        as_engine_state(engine).load(Path(local))
        self.placement.release(local, self.ctx)
        return chosen


def checkpoint_mode(requested: str, ctx: Any, engine: Any, plan: Optional[dict[str, Any]]) -> str:
    """sync | async for this attempt, the same on every rank (a collective): the requested mode, unless the engine
    cannot be captured or the snapshot (the plan's bytes) does not fit the host memory available now on the
    fullest node; one line says which and why."""
    if requested == "sync":
        return "sync"
    problem = as_engine_state(engine).async_problem()
    seen = gather_objects((ctx.node_id, HOST_FRACTION * host_available_bytes(), problem))
    problems = [p for _, _, p in seen if p]
    plan = plan or {}
    if problems:
        mode, why = "sync", f"resilience.checkpoint_mode {requested} -> sync: {problems[0]}"
    else:
        mode, why = choose_mode(requested, float(plan.get("snapshot_bytes_per_rank", 0)),
                                float(plan.get("snapshot_bytes_per_node", 0)), min(a for _, a, _ in seen))
    fallback = mode == "sync" and (requested == "async" or "available" in why or bool(problems))
    log_rank(log, "checkpoints: %s", why, level=logging.WARNING if fallback else logging.INFO)
    return mode


def _median(xs: list[float]) -> Optional[float]:
    return sorted(xs)[len(xs) // 2] if xs else None


def host_available_bytes() -> float:
    """Host memory available now on this node (MemAvailable)."""
    try:
        import psutil

        return float(psutil.virtual_memory().available)
    except Exception:
        return 0.0
