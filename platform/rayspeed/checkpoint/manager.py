"""The checkpoint manager: which checkpoint a (re)started attempt resumes from, its staging from an object store,
the universal conversion after a layout change, loading, saving under the manifest protocol, RNG, retention and
the watchdog's rollback. It hands the trainer the client state it saved (step, data position, restarts) instead
of reaching into the trainer.

    chosen, meta = choose(ctx)                                # collective: rank 0 picks, everyone agrees
    ckpt = CheckpointManager(cfg, ctx, chosen, meta, run_id, chaos)
    ds_config = ckpt.prepare(ds_config)                       # converts to universal when the layout changed
    client = ckpt.load(engine)                                # {"step", "data", "restarts"} or None
    if ckpt.should_save(step): stall = ckpt.save(step, engine, client_state)
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from rayspeed import paths, storage
from rayspeed.checkpoint import manifest, resume, rng, staging
from rayspeed.checkpoint.consolidate import manifest_model_meta
from rayspeed.config.layout import Layout
from rayspeed.config.load import to_dict
from rayspeed.config.schema import JobConfig
from rayspeed.logs import log_rank
from rayspeed.parallel.objects import broadcast_object, gather_objects, raise_first_error

log = logging.getLogger("rayspeed.checkpoint")


def choose(ctx: Any) -> tuple[Optional[str], Optional[dict[str, Any]]]:
    """The checkpoint this attempt resumes from and its manifest (None, None: a fresh start). A collective: rank 0
    picks the newest verified checkpoint (Ray Train's latest when it verifies) and every rank gets its choice."""
    exp = storage.locate(ctx.experiment_dir)
    chosen = None
    if ctx.is_rank0:
        preferred = None
        if ctx.under_ray:
            import ray.train

            ck = ray.train.get_checkpoint()
            preferred = ck.path if ck is not None else None
            if preferred and not exp.is_local:
                preferred = str(exp.child(preferred.rstrip("/").rsplit("/", 1)[-1]))
        found = resume.choose(ctx.experiment_dir, preferred, deep=exp.is_local)
        chosen = str(found) if found else None
    chosen = broadcast_object(chosen)
    return chosen, (manifest.read_manifest(chosen) if chosen else None)


def config_hash(cfg: JobConfig) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


class CheckpointManager:
    def __init__(self, cfg: JobConfig, ctx: Any, chosen: Optional[str] = None, meta: Optional[dict[str, Any]] = None,
                 run_id: Optional[str] = None, chaos: Any = None, identity: Optional[dict[str, Any]] = None):
        self.cfg, self.ctx, self.run_id, self.chaos = cfg, ctx, run_id, chaos
        self.identity = identity  # what the run computes, as submitted (rayspeed.train.resume_guard)
        self.chosen, self.meta = chosen, meta
        self.exp = storage.locate(ctx.experiment_dir)
        # Node-local staging, used only when the experiment lives on an object store.
        self.stage = staging.node_dir(paths.staging_root(cfg.storage.staging_dir), cfg.name, ctx.node_id)
        self.every = cfg.resilience.checkpoint_every_steps
        self._local: Optional[str] = None  # the chosen checkpoint as a local folder (staged when remote)
        self._tag = resume.DS_TAG
        self._module_only = False
        self.stalls: list[float] = []
        self.last_bytes: Optional[int] = None

    # ------------------------------------------------------------------ loading
    def prepare(self, ds_config: dict[str, Any]) -> dict[str, Any]:
        """Stage the chosen checkpoint (object stores) and convert it to a universal checkpoint when its ZeRO
        partitions were written for another layout; returns the DeepSpeed config to build the engine with."""
        if not self.chosen:
            return ds_config
        self._local = self.chosen if self.exp.is_local else self._stage(self.chosen)
        now = Layout.from_parallel(self.cfg.parallel).partition()
        old_zero = int(((self.meta or {}).get("layout") or {}).get("zero_stage", 0))
        if old_zero == 0 and now["zero_stage"] > 0:
            # A ZeRO-0 checkpoint holds whole weights and a plain optimizer state dict, not the partitions the
            # universal converter reads: the weights carry over, the optimizer state starts again.
            self._module_only = True
            log_rank(log, "resume: the checkpoint is ZeRO-0 and this world runs ZeRO-%d (the pinned stage does not "
                     "fit): weights restored, optimizer state restarts", now["zero_stage"], level=logging.WARNING)
        elif resume.needs_universal(self.meta or {}, now):
            # Local storage: rank 0 converts the shared copy once. Object storage: every node converts its own
            # staged copy (the same input, so the same output), in parallel.
            converter = self.ctx.is_rank0 if self.exp.is_local else self.ctx.local_rank == 0
            if converter:
                log.info("layout changed %s -> %s: converting %s to a universal checkpoint",
                         (self.meta or {}).get("layout"), now, manifest.name_of(self.chosen))
                resume.convert_to_universal(self._local)
            else:  # bounded polling of the converter's markers, never a collective under the group's timeout
                resume.wait_converted(self._local, self.cfg.resilience.conversion_timeout_s)
            self._tag = resume.UNIVERSAL_TAG
            ds_config = {**ds_config, "checkpoint": {"load_universal": True}}
        return ds_config

    def load(self, engine: Any) -> Optional[dict[str, Any]]:
        """Load the prepared checkpoint into the engine; the client state it was saved with (None: fresh start)."""
        if not self.chosen:
            return None
        path = self._local
        full = not self._module_only
        _, client = engine.load_checkpoint(path, tag=self._tag, load_optimizer_states=full,
                                           load_lr_scheduler_states=full, load_module_only=not full)
        if client is None:
            raise RuntimeError(f"DeepSpeed could not load {path} (tag {self._tag})")
        if (self.meta or {}).get("world_size") == self.ctx.world_size:
            rng.load(Path(path), self.ctx.rank)
        self._release_staged(path)
        log_rank(log, "resumed from %s at step %d (restart %d, world %s -> %d)", manifest.name_of(self.chosen),
                 int(client["step"]), int(client.get("restarts", 0)) + 1, (self.meta or {}).get("world_size"),
                 self.ctx.world_size)
        return client

    def _stage(self, chosen: str) -> str:
        """Object storage: local rank 0 of each node downloads and verifies `chosen`; the node's other ranks wait.
        Returns the staged local folder (the same path on every rank of a node)."""
        name = manifest.name_of(chosen)
        err = None
        local = self.stage / "load" / name
        if self.ctx.local_rank == 0:
            t0 = time.perf_counter()
            try:
                staging.fetch(self.exp, name, self.stage)
                log.info("staged %s from %s into %s in %.1f s", name, self.exp, local, time.perf_counter() - t0)
            except Exception as e:
                err = f"{type(e).__name__}: {e}"
        # Also the barrier the node's other ranks wait at.
        raise_first_error(gather_objects(err), f"could not stage checkpoint {name}: ")
        return str(local)

    def _release_staged(self, path: str) -> None:
        if self.exp.is_local:
            return
        dist.barrier()  # every rank on this node has loaded the staged copy
        if self.ctx.local_rank == 0:
            staging.clean(Path(path))

    # ------------------------------------------------------------------ saving
    def should_save(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.cfg.train.max_steps

    def save(self, step: int, engine: Any, client: dict[str, Any]) -> float:
        """Commit protocol (rayspeed.checkpoint.manifest): shards into a fresh folder, each rank fsyncs and hashes
        its share, then one manifest and (local storage) the rename that commits. Returns the stall."""
        t0 = time.perf_counter()
        exp, name = self.exp, manifest.dir_name(step)
        self._drill(step, "before_shards")
        if exp.is_local:
            # Never into an existing folder: a torn save at another world size must not leave files behind.
            d = manifest.saving_dir(exp.local, step)
            if self.ctx.is_rank0:
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir(parents=True)
        else:  # DeepSpeed writes local files: this rank's part goes to staging, then to the store
            d = staging.save_dir(self.stage, self.ctx.rank, step)
            if self.ctx.is_rank0 and exp.exists(name):
                # The same step saved again after a rollback or a resume from an older checkpoint: the old
                # objects (a manifest, a rejected.json) must not mix with the new ones.
                exp.delete(name)
        dist.barrier()
        engine.save_checkpoint(str(d), tag=resume.DS_TAG, client_state={**client, "mlflow_run_id": self.run_id},
                               save_latest=False)
        self._drill(step, "between_shards")
        rng.save(d, self.ctx.rank)
        if exp.is_local:
            dist.barrier()  # every rank's files are written: each now makes its share durable and hashes it
            rels = manifest.list_files(d)
            mine = manifest.durable_entries(d, rels[self.ctx.rank::self.ctx.world_size])
        else:
            mine = staging.publish(exp, d)  # hashed on local disk, then uploaded
        files = {k: v for part in gather_objects(mine) for k, v in part.items()}  # every rank's part is done
        self._drill(step, "before_manifest")
        dist.barrier()  # the manifest commits only while every rank is alive past its shards
        if self.ctx.is_rank0:
            if exp.is_local:
                manifest.write_manifest(d, step, self._meta(), files)
                manifest.commit_dir(d, exp.local / name)
            else:
                manifest.write_manifest(str(exp.child(name)), step, self._meta(), files)
        dist.barrier()
        self._drill(step, "after_manifest")
        if self.ctx.under_ray:
            self._report(name, exp.local / name if exp.is_local else d)
        if self.ctx.is_rank0:
            for p in manifest.prune(str(exp), self.cfg.resilience.keep_checkpoints):
                log.info("deleted old checkpoint %s", manifest.name_of(p))
            if exp.is_local:
                manifest.clean_stale_saves(exp.local)
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        self.last_bytes = sum(int(v["bytes"]) for v in files.values())
        return stall

    def _drill(self, step: int, point: str) -> None:
        if self.chaos is not None:
            self.chaos.in_checkpoint(step, point)

    def _report(self, name: str, d: Path) -> None:
        """Tell Ray Train about the committed checkpoint (it restarts attempts from the latest it knows)."""
        import ray.train
        from ray.train import Checkpoint, CheckpointUploadMode

        if self.exp.is_local:
            ck = Checkpoint.from_directory(str(d))
        else:  # a pointer into the store, on the filesystem Ray Train itself uses for the run
            sc = ray.train.get_context().get_storage()
            ck = Checkpoint(path=f"{sc.experiment_fs_path.rstrip('/')}/{name}", filesystem=sc.storage_filesystem)
        ray.train.report({"step": int(manifest.step_of(name) or 0)}, checkpoint=ck, checkpoint_dir_name=name,
                         checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)

    def _meta(self) -> dict[str, Any]:
        import deepspeed

        c = self.cfg
        return {
            "job": c.name,
            "world_size": self.ctx.world_size,
            "layout": Layout.from_parallel(c.parallel).record(),
            "global_batch_size": c.train.global_batch_size,
            "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__},
            "config_hash": config_hash(c),
            "run_identity": self.identity,
            **manifest_model_meta(c),  # lets `rayspeed export <checkpoint dir>` rebuild the model on its own
        }

    def median_stall(self) -> Optional[float]:
        return sorted(self.stalls)[len(self.stalls) // 2] if self.stalls else None

    # ------------------------------------------------------------------ rollback
    def rollback(self, engine: Any) -> Optional[str]:
        """Restore the newest verified checkpoint into the engine in place (the watchdog's remedy); its name, or
        None when there is nothing to restore."""
        chosen = None
        if self.ctx.is_rank0:
            found, _ = manifest.latest_verified(self.ctx.experiment_dir, deep=self.exp.is_local)
            chosen = str(found) if found else None
        chosen = broadcast_object(chosen)
        if chosen is None:
            return None
        local = chosen if self.exp.is_local else self._stage(chosen)
        engine.load_checkpoint(local, tag=resume.DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True)
        self._release_staged(local)
        return chosen
