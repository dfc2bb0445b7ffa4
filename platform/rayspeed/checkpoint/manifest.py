"""Checkpoint commit protocol.

On local or NFS storage every rank writes its shard into a hidden `.checkpoint_stepNNNNNNNN.saving/` folder,
fsyncs and hashes its share of the files; rank 0 then writes one manifest (step, world and layout, every file
with its size and sha256, versions, config hashes) into it (temporary name, fsync, rename) and renames the folder
into place: that rename is the commit. A checkpoint without a manifest that verifies does not exist: it is never
resumed from, and older checkpoints are deleted only after a newer one committed. The sha256s give integrity
(the bytes are the ones the ranks wrote: no torn or truncated shard is ever loaded), not authenticity: anyone who
can write to the storage can write a matching manifest. DeepSpeed unpickles what it loads, so keep the storage
writable by the job's own identity only.

Where checkpoints live: every function reads and writes through a `rayspeed.storage.Location` (a local or NFS
path, as a str or Path; a URI: s3://bucket/prefix, gs://..., any scheme pyarrow's `FileSystem.from_uri` resolves,
e.g. mock:// in tests; memory://); every function also takes a Location itself, or `filesystem=` (a pyarrow
FileSystem, e.g. Ray Train's `storage_filesystem`) with a path inside it (`experiment_fs_path`). Paths come back in
the form they were given: Path for a local folder, str otherwise (URIs stay URIs). The commit is the same protocol
everywhere: shards first, the manifest last, written with the location's `commit` (on a disk: temporary name,
fsync, rename; on an object store, which has no rename, one PUT: readers see the whole manifest or none).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayspeed.paths import is_uri
from rayspeed.storage import Location, at
from rayspeed.storage.local_disk import fsync_dir

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
# Written next to the manifest when a staged copy fails its sha256 check (the store's object changed after the
# commit): the checkpoint then never verifies again, so the next attempt resumes from an older one instead of
# downloading the same bad bytes until the restarts run out.
REJECTED = "rejected.json"
PREFIX = "checkpoint_step"
_DIR_RE = re.compile(rf"^{PREFIX}(\d+)$")
FORMAT_VERSION = 1


def dir_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def step_of(path: str | Path) -> int | None:
    name = str(path).rstrip("/").rsplit("/", 1)[-1] if is_uri(path) else Path(path).name
    m = _DIR_RE.match(name)
    return int(m.group(1)) if m else None


def _sha256(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            b = fh.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def list_files(ckpt_dir: str | Path | Location, *, filesystem: Any = None) -> list[Path]:
    """The checkpoint's files (relative paths), without its manifest, marker and temporaries."""
    return [Path(rel) for rel, _ in at(ckpt_dir, filesystem).files()
            if rel not in (MANIFEST, REJECTED) and not rel.rsplit("/", 1)[-1].endswith(".tmp")]


def file_entries(ckpt_dir: str | Path | Location, rels: list[Path], *,
                 filesystem: Any = None) -> dict[str, dict[str, Any]]:
    """Size and sha256 of files (each rank hashes the files it wrote, in parallel across ranks)."""
    loc = at(ckpt_dir, filesystem)
    return {str(rel): {"bytes": loc.size(str(rel)), "sha256": loc.sha256(str(rel))} for rel in rels}


def durable_entries(ckpt_dir: Path, rels: list[Path]) -> dict[str, dict[str, Any]]:
    """fsync each file (its bytes reach the disk before any manifest names them) and record its size and sha256,
    read back while it is still in the page cache. Each rank does this for its share of the files, in parallel."""
    out = {}
    for rel in rels:
        p = Path(ckpt_dir) / rel
        with open(p, "rb") as fh:
            os.fsync(fh.fileno())
        out[str(rel)] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    return out


def saving_dir(root: Path, step: int) -> Path:
    """Where checkpoint `step` is written before its commit: a hidden sibling that `candidates` never lists."""
    return Path(root) / f".{dir_name(step)}.saving"


def commit_dir(saving: Path, final: Path) -> None:
    """Make a fully written (manifest included) folder the checkpoint: rename it into place. A checkpoint of the
    same step already there (a re-save after a rollback or an older resume) is moved aside first and deleted
    after, so no file of one save ever mixes with another's."""
    aside = None
    if final.exists():
        aside = final.with_name(f".{final.name}.replaced-{os.getpid()}-{time.time_ns()}")
        os.replace(final, aside)
    os.replace(saving, final)
    fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def clean_stale_saves(root: Path, keep: Path | None = None) -> list[Path]:
    """Delete what crashed saves left (hidden .saving / .replaced folders), except `keep`."""
    removed: list[Path] = []
    root = Path(root)
    if not root.is_dir():
        return removed
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(f".{PREFIX}") and (".saving" in p.name or ".replaced-" in p.name):
            if keep is not None and p == keep:
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def write_manifest(ckpt_dir: str | Path | Location, step: int, meta: dict[str, Any],
                   files: dict[str, dict[str, Any]] | None = None, *, filesystem: Any = None) -> Any:
    """Commit: hash every file (unless given) and write the manifest with the location's commit (on a disk:
    manifest.json.tmp, fsync, rename, fsync the folder; on an object store: one PUT). Returns the manifest's path
    in the caller's form (a Path for a local folder, a str otherwise)."""
    loc = at(ckpt_dir, filesystem)
    listed = list_files(loc)
    files = dict(files) if files is not None else file_entries(loc, listed)
    missing = [f for f in listed if str(f) not in files]
    if missing:
        files.update(file_entries(loc, missing))
    manifest = {"format": FORMAT_VERSION, "step": step, "written_at": time.time(), "files": files, **meta}
    loc.commit(MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    return loc.child(MANIFEST).handle


def read_manifest(ckpt_dir: str | Path | Location, *, filesystem: Any = None) -> dict[str, Any] | None:
    data = at(ckpt_dir, filesystem).read_bytes(MANIFEST)
    try:
        return json.loads(data) if data is not None else None
    except ValueError:
        return None


@dataclass
class Verdict:
    ok: bool
    reason: str = ""


def verify(ckpt_dir: str | Path | Location, deep: bool = True, *, filesystem: Any = None) -> Verdict:
    """A checkpoint is valid when its manifest parses and every file it lists exists with the recorded
    size and (deep) sha256."""
    loc = at(ckpt_dir, filesystem)
    m = read_manifest(loc)
    bad = _manifest_problem(m)
    if bad:
        return Verdict(False, bad)
    assert m is not None  # _manifest_problem has a reason for a missing manifest
    if loc.size(REJECTED) is not None:
        return _rejected(lambda: loc.read_bytes(REJECTED))
    files = m["files"]
    rels = list(files)
    for rel, size in zip(rels, loc.sizes(rels)):
        e = files[rel]
        if size is None:
            return Verdict(False, f"{rel} is missing")
        if size != e["bytes"]:
            return Verdict(False, f"{rel} has {size} bytes, manifest says {e['bytes']}")
        if deep and loc.sha256(rel) != e["sha256"]:
            return Verdict(False, f"{rel} does not match its sha256")
    return Verdict(True)


def _manifest_problem(m: dict[str, Any] | None) -> str | None:
    if m is None:
        return "no readable manifest (incomplete write)"
    if m.get("format") != FORMAT_VERSION:
        return f"manifest format {m.get('format')} is not {FORMAT_VERSION}"
    if not m.get("files"):
        return "manifest lists no files"
    return None


def _rejected(read: Any) -> Verdict:
    """The verdict for a checkpoint carrying REJECTED; `read()` returns the marker's bytes."""
    try:
        why = str(json.loads(read()).get("reason", "no reason recorded"))[:300]
    except Exception:  # the marker alone is enough
        why = "unreadable marker"
    return Verdict(False, f"rejected earlier ({why})")


def candidates(root: str | Path | Location, *, filesystem: Any = None) -> list[Any]:
    """Checkpoint folders under root, newest step first, in the caller's form (Paths for a local root)."""
    loc = at(root, filesystem)
    found = [(int(m.group(1)), name) for name in loc.subdirs() if (m := _DIR_RE.match(name))]
    return [loc.child(name).handle for _, name in sorted(found, reverse=True)]


def latest_verified(root: str | Path, deep: bool = True, *, filesystem: Any = None) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and one line per newer one that was skipped and why."""
    skipped: list[str] = []
    for p in candidates(root, filesystem=filesystem):
        v = verify(p, deep=deep, filesystem=filesystem)
        if v.ok:
            return p, skipped
        skipped.append(f"{name_of(p)}: {v.reason}")
    return None, skipped


def name_of(p: str | Path) -> str:
    return p.name if isinstance(p, Path) else str(p).rstrip("/").rsplit("/", 1)[-1]


def prune(root: str | Path, keep: int, *, filesystem: Any = None) -> list[Path]:
    """Delete what is no longer needed: verified checkpoints beyond the newest `keep`, and unverified
    (partial) ones older than the newest verified. Never touches anything newer than the newest verified
    checkpoint (it may be being written)."""
    keep = max(2, keep)
    removed = []
    verified_seen = 0
    newest_verified_step = None
    for p in candidates(root, filesystem=filesystem):
        v = verify(p, deep=False, filesystem=filesystem)
        if newest_verified_step is None:
            if v.ok:
                newest_verified_step = step_of(p)
                verified_seen = 1
            continue
        if v.ok:
            verified_seen += 1
            if verified_seen <= keep:
                continue
        try:
            at(p, filesystem).delete()
        except OSError as e:
            log.warning("could not delete %s: %s", p, e)
            continue
        removed.append(p)
    return removed
