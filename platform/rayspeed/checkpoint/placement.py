"""Where a rank's checkpoint files are written before the commit, how they become durable, and how the commit is
made, by the kind of location the experiment lives on. The manager and the background writer ask a placement;
the one question "is this a folder DeepSpeed can write into?" is asked once, in `placement_for`.

* `InPlace` (local disk or NFS): every rank writes into the shared hidden `.checkpoint_stepN.saving/` folder, each
  fsyncs and hashes its share, rank 0 writes the manifest into it and renames the folder into place (the commit).
  Resuming loads the checkpoint where it is; rank 0 converts it once after a layout change.
* `Staged` (an object store, memory://, anything else): DeepSpeed writes into node-local staging, each rank hashes
  and uploads its own files (rayspeed.checkpoint.staging), rank 0 commits the manifest into the location. Resuming
  downloads and verifies one copy per node; each node converts its own copy.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from rayspeed.checkpoint import manifest, staging
from rayspeed.parallel.objects import barrier, gather_objects, raise_first_error
from rayspeed.storage import Location, locate

log = logging.getLogger("rayspeed.checkpoint")


class InPlace:
    deep_verify = True
    """Hashing every file to choose a checkpoint is a local read here."""
    poll_s = 0.2

    def __init__(self, exp: Location):
        self.exp = exp

    def converts(self, ctx: Any) -> bool:
        """This rank converts the chosen checkpoint to a universal one (rank 0 converts the shared copy once)."""
        return bool(ctx.is_rank0)

    def local_copy(self, chosen: str, ctx: Any) -> str:
        """The chosen checkpoint as a local folder DeepSpeed loads from."""
        return chosen

    def release(self, path: str, ctx: Any) -> None:
        """The engine loaded `path`: nothing to clean where it is the checkpoint itself."""

    def fresh_folder(self, step: int, ctx: Any) -> Path:
        """Where this rank writes checkpoint `step`; rank 0 makes it (every rank waits at a barrier after this)."""
        # Never into an existing folder: a torn save at another world size must not leave files behind.
        d = manifest.saving_dir(self.exp.local, step)
        if ctx.is_rank0:
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        return d

    def durable_share(self, folder: Path, ctx: Any) -> dict[str, dict[str, Any]]:
        """Synchronous save: this rank's share of every rank's files made durable, with sizes and sha256s."""
        barrier()  # every rank's files are written: each now makes its share durable and hashes it
        rels = manifest.list_files(folder)
        return manifest.durable_entries(folder, rels[ctx.rank::ctx.world_size])

    def claimed(self, folder: Path, is_rank0: bool) -> list[str]:
        """Asynchronous save: what DeepSpeed copied in directly (zero_to_fp32.py), before any rank writes a shard;
        rank 0 commits it. A collective."""
        out = [str(folder / r) for r in manifest.list_files(folder)] if is_rank0 else []
        barrier()
        return out

    def durable_own(self, folder: Path, name: str, written: list[str]) -> dict[str, dict[str, Any]]:
        """Asynchronous save: the files this rank wrote made durable, with sizes and sha256s."""
        rels = sorted({str(Path(p).relative_to(folder)) for p in written})
        return manifest.durable_entries(folder, [Path(r) for r in rels])

    def stored(self, folder: Path, name: str) -> Location:
        """Where the files of the save in progress are, before the commit."""
        return locate(folder)

    def commit(self, folder: Path, name: str, step: int, meta: dict[str, Any],
               files: dict[str, dict[str, Any]]) -> None:
        manifest.write_manifest(folder, step, meta, files)
        manifest.commit_dir(folder, self.exp.local / name)

    def after_commit(self) -> None:
        manifest.clean_stale_saves(self.exp.local)


class Staged:
    deep_verify = False
    """Hashing means downloading: the sha256s are checked on the staged copy (staging.fetch)."""
    poll_s = 1.0

    def __init__(self, exp: Location, stage: Optional[Path] = None):
        self.exp, self.stage = exp, stage

    def converts(self, ctx: Any) -> bool:
        """Every node converts its own staged copy (the same input, so the same output), in parallel."""
        return ctx.local_rank == 0

    def local_copy(self, chosen: str, ctx: Any) -> str:
        """Local rank 0 of each node downloads and verifies `chosen`; the node's other ranks wait. The staged
        folder is the same path on every rank of a node."""
        assert self.stage is not None, "staging needs the node's staging folder"
        name = manifest.name_of(chosen)
        err = None
        local = self.stage / "load" / name
        if ctx.local_rank == 0:
            t0 = time.perf_counter()
            try:
                staging.fetch(self.exp, name, self.stage)
                log.info("staged %s from %s into %s in %.1f s", name, self.exp, local, time.perf_counter() - t0)
            except Exception as e:
                err = f"{type(e).__name__}: {e}"
        # Also the barrier the node's other ranks wait at.
        raise_first_error(gather_objects(err), f"could not stage checkpoint {name}: ")
        return str(local)

    def release(self, path: str, ctx: Any) -> None:
        barrier()  # every rank on this node has loaded the staged copy
        if ctx.local_rank == 0:
            staging.clean(Path(path))

    def fresh_folder(self, step: int, ctx: Any) -> Path:
        assert self.stage is not None, "staging needs the node's staging folder"
        d = staging.save_dir(self.stage, ctx.rank, step)
        name = manifest.dir_name(step)
        if ctx.is_rank0 and self.exp.exists(name):
            # The same step saved again after a rollback or a resume from an older checkpoint: the old objects (a
            # manifest, a rejected.json) must not mix with the new ones.
            self.exp.delete(name)
        return d

    def durable_share(self, folder: Path, ctx: Any) -> dict[str, dict[str, Any]]:
        return staging.publish(self.exp, folder)  # hashed on local disk, then uploaded

    def claimed(self, folder: Path, is_rank0: bool) -> list[str]:
        return []  # a staging folder is this rank's own: nothing in it is another rank's to commit

    def durable_own(self, folder: Path, name: str, written: list[str]) -> dict[str, dict[str, Any]]:
        """Hashed on local staging, uploaded, every object's size checked, and only then the staging copy goes."""
        entries = manifest.file_entries(folder, manifest.list_files(folder))
        self.exp.upload_dir(folder, name)
        stored = dict(self.exp.child(name).files())
        wrong = [f"{rel} ({stored.get(rel)} bytes stored, {e['bytes']} written)" for rel, e in entries.items()
                 if stored.get(rel) != e["bytes"]]
        if wrong:
            raise RuntimeError(f"upload of {name} to {self.exp} did not verify: " + ", ".join(wrong[:5]))
        shutil.rmtree(folder, ignore_errors=True)
        return entries

    def stored(self, folder: Path, name: str) -> Location:
        return self.exp.child(name)

    def commit(self, folder: Path, name: str, step: int, meta: dict[str, Any],
               files: dict[str, dict[str, Any]]) -> None:
        manifest.write_manifest(self.exp.child(name), step, meta, files)

    def after_commit(self) -> None:
        """Nothing is left behind: there is no hidden folder in the store."""


Placement = InPlace | Staged


def placement_for(exp: Location, stage: Optional[Path] = None) -> Placement:
    """InPlace where DeepSpeed can write into the experiment's folder, Staged everywhere else."""
    return InPlace(exp) if exp.is_local else Staged(exp, stage)
