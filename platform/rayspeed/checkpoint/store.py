"""Checkpoint commit protocol.

Every rank writes its shard into `checkpoint_stepNNNNNNNN/`; then rank 0 writes one manifest (step,
world and layout, every file with its size and sha256, versions, config hash) to a temporary name,
fsyncs it and renames it into place. A checkpoint without a manifest that verifies does not exist:
it is never resumed from (DeepSpeed unpickles what it loads, so only files this platform wrote and
verified are ever loaded), and older checkpoints are deleted only after a newer one verified.
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

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PREFIX = "checkpoint_step"
_DIR_RE = re.compile(rf"^{PREFIX}(\d+)$")
FORMAT_VERSION = 1


def dir_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def step_of(path: str | Path) -> int | None:
    m = _DIR_RE.match(Path(path).name)
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


def list_files(ckpt_dir: Path) -> list[Path]:
    out = []
    for root, _, files in os.walk(ckpt_dir):
        for f in files:
            p = Path(root) / f
            rel = p.relative_to(ckpt_dir)
            if str(rel) == MANIFEST or rel.name.endswith(".tmp"):
                continue
            out.append(rel)
    return sorted(out)


def file_entries(ckpt_dir: Path, rels: list[Path]) -> dict[str, dict[str, Any]]:
    """Size and sha256 of files (each rank hashes the files it wrote, in parallel across ranks)."""
    entries = {}
    for rel in rels:
        p = ckpt_dir / rel
        entries[str(rel)] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    return entries


def write_manifest(ckpt_dir: str | Path, step: int, meta: dict[str, Any], files: dict[str, dict[str, Any]] | None = None) -> Path:
    """Commit: hash every file (unless given), write manifest.json.tmp, fsync, rename, fsync the folder."""
    ckpt_dir = Path(ckpt_dir)
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


def read_manifest(ckpt_dir: str | Path) -> dict[str, Any] | None:
    p = Path(ckpt_dir) / MANIFEST
    try:
        with open(p) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


@dataclass
class Verdict:
    ok: bool
    reason: str = ""


def verify(ckpt_dir: str | Path, deep: bool = True) -> Verdict:
    """A checkpoint is valid when its manifest parses and every file it lists exists with the recorded
    size and (deep) sha256."""
    ckpt_dir = Path(ckpt_dir)
    m = read_manifest(ckpt_dir)
    if m is None:
        return Verdict(False, "no readable manifest (incomplete write)")
    if m.get("format") != FORMAT_VERSION:
        return Verdict(False, f"manifest format {m.get('format')} is not {FORMAT_VERSION}")
    files = m.get("files") or {}
    if not files:
        return Verdict(False, "manifest lists no files")
    for rel, e in files.items():
        p = ckpt_dir / rel
        if not p.is_file():
            return Verdict(False, f"{rel} is missing")
        if p.stat().st_size != e["bytes"]:
            return Verdict(False, f"{rel} has {p.stat().st_size} bytes, manifest says {e['bytes']}")
        if deep and _sha256(p) != e["sha256"]:
            return Verdict(False, f"{rel} does not match its sha256")
    return Verdict(True)


def candidates(root: str | Path) -> list[Path]:
    """Checkpoint folders under root, newest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return [p for _, p in sorted(found, reverse=True)]


def latest_verified(root: str | Path, deep: bool = True) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and one line per newer one that was skipped and why."""
    skipped = []
    for p in candidates(root):
        v = verify(p, deep=deep)
        if v.ok:
            return p, skipped
        skipped.append(f"{p.name}: {v.reason}")
    return None, skipped


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete what is no longer needed: verified checkpoints beyond the newest `keep`, and unverified
    (partial) ones older than the newest verified. Never touches anything newer than the newest verified
    checkpoint (it may be being written)."""
    keep = max(2, keep)
    removed = []
    verified_seen = 0
    newest_verified_step = None
    for p in candidates(root):
        v = verify(p, deep=False)
        if newest_verified_step is None:
            if v.ok:
                newest_verified_step = step_of(p)
                verified_seen = 1
            continue
        if v.ok:
            verified_seen += 1
            if verified_seen <= keep:
                continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed
