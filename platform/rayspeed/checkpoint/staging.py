"""Checkpoints on an object store go through node-local staging: DeepSpeed reads and writes local files only.

Save (every rank): DeepSpeed writes into `<staging>/<job>/node-<id>/save/rank<R>/checkpoint_stepN/`, the rank
hashes what it wrote (on local disk, in parallel with the other ranks), uploads it next to the other ranks'
files in the store and deletes its staging copy; rank 0 then commits the manifest from everyone's hashes
(manifest.write_manifest: the checkpoint exists only once that manifest is in the store). Each rank writes
files with distinct names (DeepSpeed names shards by rank; rng_rank<R>.pt), so the uploads never collide.
The upload is synchronous: the training stall of a checkpoint is write + hash + upload of this rank's
shard (an asynchronous upload behind the next steps is a later step; the manifest-last protocol already
allows it).

Load (one downloader per node): local rank 0 of each node downloads the chosen checkpoint into
`<staging>/<job>/node-<id>/load/checkpoint_stepN/` and verifies every file against the manifest (sizes and
sha256); the node's other ranks wait at the barrier that follows. A copy that does not verify marks the
checkpoint rejected in the store, so the restart that follows resumes from the newest older one. The node id
is part of the path so hosts that share /tmp (containers, network namespaces) never write the same folder. The
staged copy is deleted once the engine has loaded it.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from rayspeed.checkpoint import manifest
from rayspeed.storage import Location

log = logging.getLogger(__name__)


def node_dir(staging_root: Path, job: str, node_id: str) -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(node_id))[:24] or "node"
    return Path(staging_root) / job / f"node-{safe}"


def save_dir(node: Path, rank: int, step: int) -> Path:
    """An empty folder for this rank's part of checkpoint `step` (a leftover from a crashed save is removed)."""
    d = node / "save" / f"rank{rank}" / manifest.dir_name(step)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


def publish(exp: Location, local_dir: Path) -> dict[str, dict[str, Any]]:
    """Hash and upload this rank's files of a checkpoint, then drop the staging copy. Returns the manifest
    entries ({rel: {bytes, sha256}}) for rank 0 to commit."""
    entries = manifest.file_entries(local_dir, manifest.list_files(local_dir))
    exp.upload_dir(local_dir, local_dir.name)
    shutil.rmtree(local_dir, ignore_errors=True)
    return entries


def fetch(exp: Location, name: str, node: Path) -> Path:
    """Download checkpoint `name` (a folder of exp) into this node's staging and verify it against its manifest
    (deep: every sha256). Raises RuntimeError with the reason when the copy does not verify."""
    d = node / "load" / name
    shutil.rmtree(d, ignore_errors=True)
    exp.download_dir(name, d)
    v = manifest.verify(d, deep=True)
    if not v.ok:
        shutil.rmtree(d, ignore_errors=True)
        try:  # never again: the next attempt resumes from an older checkpoint (manifest.REJECTED)
            exp.child(name).write_json(manifest.REJECTED, {"reason": v.reason, "time": time.time()})
        except Exception as e:
            log.warning("could not mark %s rejected: %s", name, e)
        raise RuntimeError(f"checkpoint {name} downloaded from {exp} does not verify: {v.reason}")
    return d


def clean(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
