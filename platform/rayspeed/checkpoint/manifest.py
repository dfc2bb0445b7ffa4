"""Checkpoint commit protocol.

On local or NFS storage every rank writes its shard into a hidden `.checkpoint_stepNNNNNNNN.saving/` folder,
fsyncs and hashes its share of the files; rank 0 then writes one manifest (step, world and layout, every file
with its size and sha256, versions, config hashes) into it (temporary name, fsync, rename) and renames the folder
into place: that rename is the commit. A checkpoint without a manifest that verifies does not exist: it is never
resumed from, and older checkpoints are deleted only after a newer one committed. The sha256s give integrity
(the bytes are the ones the ranks wrote: no torn or truncated shard is ever loaded), not authenticity: anyone who
can write to the storage can write a matching manifest. DeepSpeed unpickles what it loads, so keep the storage
writable by the job's own identity only.

Where checkpoints live: a local (or NFS) path, as a str or Path, takes the plain filesystem code path below
(unchanged). A URI that Ray Train's storage accepts (s3://bucket/prefix, gs://..., any scheme pyarrow's
`FileSystem.from_uri` resolves, e.g. mock:// in tests) goes through a pyarrow filesystem, resolved once per
root and reused for everything under it; every function also takes `filesystem=` (a pyarrow FileSystem, e.g.
Ray Train's `storage_filesystem`) with a path inside it (`experiment_fs_path`). On such storage the functions
return str paths in the form they were given (URIs stay URIs), where local calls return Path. The commit is
the same protocol: shards first, the manifest last. Object stores (S3, GCS, Azure) have no rename, but a
single object PUT is atomic (readers see the whole manifest or none), so the manifest is written in one PUT;
other filesystems write manifest.json.tmp and move it into place.
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
from rayspeed.storage import Location, local_path, resolve

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


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def list_files(ckpt_dir: Path, *, filesystem: Any = None) -> list[Path]:
    r = resolve(ckpt_dir, filesystem)
    if r is not None:  # relative paths as str (posix)
        return [rel for rel, _ in r.files()  # type: ignore[misc]
                if rel not in (MANIFEST, REJECTED) and not rel.rsplit("/", 1)[-1].endswith(".tmp")]
    ckpt_dir = local_path(ckpt_dir)
    out = []
    for root, _, files in os.walk(ckpt_dir):
        for f in files:
            p = Path(root) / f
            rel = p.relative_to(ckpt_dir)
            if str(rel) in (MANIFEST, REJECTED) or rel.name.endswith(".tmp"):
                continue
            out.append(rel)
    return sorted(out)


def file_entries(ckpt_dir: Path, rels: list[Path], *, filesystem: Any = None) -> dict[str, dict[str, Any]]:
    """Size and sha256 of files (each rank hashes the files it wrote, in parallel across ranks)."""
    r = resolve(ckpt_dir, filesystem)
    if r is not None:
        out = {}
        for rel in rels:
            f = r.child(str(rel))
            out[str(rel)] = {"bytes": int(f.fs.get_file_info(f.fs_path).size), "sha256": f.sha256()}
        return out
    ckpt_dir = local_path(ckpt_dir)
    entries = {}
    for rel in rels:
        p = ckpt_dir / rel
        entries[str(rel)] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    return entries


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
    _fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def clean_stale_saves(root: Path, keep: Path | None = None) -> list[Path]:
    """Delete what crashed saves left (hidden .saving / .replaced folders), except `keep`."""
    removed = []
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


def write_manifest(ckpt_dir: str | Path, step: int, meta: dict[str, Any],
                   files: dict[str, dict[str, Any]] | None = None, *, filesystem: Any = None) -> Path:
    """Commit: hash every file (unless given), write manifest.json.tmp, fsync, rename, fsync the folder.
    (On a pyarrow filesystem: the manifest in one PUT on object stores, tmp + move elsewhere; returns a str.)"""
    r = resolve(ckpt_dir, filesystem)
    if r is not None:
        return _remote_write_manifest(r, step, meta, files)  # type: ignore[return-value]
    ckpt_dir = local_path(ckpt_dir)
    if files is None:
        files = file_entries(ckpt_dir, list_files(ckpt_dir))
    missing = [f for f in list_files(ckpt_dir) if str(f) not in files]
    if missing:
        files.update(file_entries(ckpt_dir, missing))
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "written_at": time.time(),
        "files": files,
        **meta,
    }
    tmp = ckpt_dir / (MANIFEST + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, ckpt_dir / MANIFEST)
    _fsync_dir(ckpt_dir)
    return ckpt_dir / MANIFEST


def _remote_write_manifest(r: Location, step: int, meta: dict[str, Any],
                           files: dict[str, dict[str, Any]] | None) -> str:
    listed = list_files(r.fs_path, filesystem=r.fs)
    files = dict(files) if files is not None else file_entries(r.fs_path, listed, filesystem=r.fs)
    missing = [f for f in listed if str(f) not in files]
    if missing:
        files.update(file_entries(r.fs_path, missing, filesystem=r.fs))
    manifest = {"format": FORMAT_VERSION, "step": step, "written_at": time.time(), "files": files, **meta}
    target = r.child(MANIFEST)
    target.put(json.dumps(manifest, indent=1, sort_keys=True).encode())
    return target.uri


def read_manifest(ckpt_dir: str | Path, *, filesystem: Any = None) -> dict[str, Any] | None:
    r = resolve(ckpt_dir, filesystem)
    if r is not None:
        try:
            with r.fs.open_input_stream(r.child(MANIFEST).fs_path) as fh:
                return json.loads(fh.read())
        except (OSError, ValueError):  # FileNotFoundError is an OSError
            return None
    p = local_path(ckpt_dir) / MANIFEST
    try:
        with open(p) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


@dataclass
class Verdict:
    ok: bool
    reason: str = ""


def verify(ckpt_dir: str | Path, deep: bool = True, *, filesystem: Any = None) -> Verdict:
    """A checkpoint is valid when its manifest parses and every file it lists exists with the recorded
    size and (deep) sha256."""
    r = resolve(ckpt_dir, filesystem)
    if r is not None:
        return _remote_verify(r, deep)
    ckpt_dir = local_path(ckpt_dir)
    m = read_manifest(ckpt_dir)
    bad = _manifest_problem(m)
    if bad:
        return Verdict(False, bad)
    marker = ckpt_dir / REJECTED
    if marker.exists():
        return _rejected(marker.read_bytes)
    files = m["files"]
    for rel, e in files.items():
        p = ckpt_dir / rel
        if not p.is_file():
            return Verdict(False, f"{rel} is missing")
        if p.stat().st_size != e["bytes"]:
            return Verdict(False, f"{rel} has {p.stat().st_size} bytes, manifest says {e['bytes']}")
        if deep and _sha256(p) != e["sha256"]:
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


def _remote_verify(r: Location, deep: bool) -> Verdict:
    from pyarrow import fs as pafs

    m = read_manifest(r.fs_path, filesystem=r.fs)
    bad = _manifest_problem(m)
    if bad:
        return Verdict(False, bad)
    marker = r.child(REJECTED).fs_path
    if r.fs.get_file_info(marker).type == pafs.FileType.File:
        def read() -> bytes:
            with r.fs.open_input_stream(marker) as fh:
                return fh.read()

        return _rejected(read)
    files = m["files"]
    rels = list(files)
    infos = r.fs.get_file_info([r.child(rel).fs_path for rel in rels])
    for rel, info in zip(rels, infos):
        e = files[rel]
        if info.type != pafs.FileType.File:
            return Verdict(False, f"{rel} is missing")
        if int(info.size) != e["bytes"]:
            return Verdict(False, f"{rel} has {info.size} bytes, manifest says {e['bytes']}")
        if deep and r.child(rel).sha256() != e["sha256"]:
            return Verdict(False, f"{rel} does not match its sha256")
    return Verdict(True)


def candidates(root: str | Path, *, filesystem: Any = None) -> list[Path]:
    """Checkpoint folders under root, newest step first."""
    r = resolve(root, filesystem)
    if r is not None:
        from pyarrow import fs as pafs

        found = []
        for info in r.fs.get_file_info(pafs.FileSelector(r.fs_path, allow_not_found=True)):
            name = info.path.rstrip("/").rsplit("/", 1)[-1]
            m = _DIR_RE.match(name)
            if info.type == pafs.FileType.Directory and m:
                found.append((int(m.group(1)), r.child(name).uri))
        return [p for _, p in sorted(found, reverse=True)]  # type: ignore[misc]
    root = local_path(root)
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return [p for _, p in sorted(found, reverse=True)]


def latest_verified(root: str | Path, deep: bool = True, *, filesystem: Any = None) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and one line per newer one that was skipped and why."""
    skipped = []
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
        r = resolve(p, filesystem)
        if r is None:
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                r.fs.delete_dir(r.fs_path)
            except OSError as e:
                log.warning("could not delete %s: %s", p, e)
                continue
        removed.append(p)
    return removed
