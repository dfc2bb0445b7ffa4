"""The token cache's small tools: content keys, temporary names, atomic JSON, a per-entry lock, and the
"build once, reuse everywhere" protocol every cached corpus uses.

An entry is complete once its meta file exists: it is written last, atomically (temp file + os.replace), after
the data it describes. Builders hold an fcntl lock, so several processes on one machine build an entry once
(flock is per machine: on a shared filesystem each node builds under its own lock, which is still safe because
of the atomic rename, just redundant).
"""

from __future__ import annotations

import fcntl
import glob as _glob
import hashlib
import json
import os
import secrets
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import numpy as np

FORMAT_VERSION = "rayspeed-tokens-v1"


def cache_key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:32]


def tmp_name(final: str) -> str:
    return f"{final}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def atomic_write_json(path: str, obj: dict) -> None:
    tmp = tmp_name(path)
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_meta(meta_path: str) -> Optional[dict]:
    """The meta of a complete single-file cache entry, or None (missing, other format, or data file wrong size)."""
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("format") != FORMAT_VERSION:
            return None
        # Built files are recorded by name, relative to the cache folder, so the folder can move.
        meta["data_path"] = os.path.join(os.path.dirname(meta_path), meta["data_path"])
        size = os.path.getsize(meta["data_path"])
    except (OSError, ValueError, KeyError):
        return None
    if size != meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize:
        return None
    return meta


@contextmanager
def locked(lock_path: str) -> Iterator[None]:
    # The lock file is never deleted: unlinking it would let a waiter lock an orphaned inode.
    with open(lock_path, "a") as lf:
        fcntl.flock(lf.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lf.fileno(), fcntl.LOCK_UN)


@contextmanager
def locked_dir(path: str) -> Iterator[None]:
    """An exclusive lock on a folder itself (no lock file is left behind)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def cached(cache_dir: str, key: str, build: Callable[[str], dict]) -> tuple[dict, bool]:
    """Return (meta, built). build(bin_path) writes the data (atomically) and returns its meta."""
    stem = os.path.join(cache_dir, f"tokens-{key}")
    meta_path = stem + ".json"
    meta = read_meta(meta_path)  # fast path, no lock: the meta file appears only once complete
    if meta is not None:
        return meta, False
    os.makedirs(cache_dir, exist_ok=True)
    with locked(stem + ".lock"):
        meta = read_meta(meta_path)  # another process built it while we waited
        if meta is not None:
            return meta, False
        # Only the lock holder writes temp files for this key, so any left are from a crashed builder.
        for stale in _glob.glob(_glob.escape(stem) + ".*.tmp"):
            os.unlink(stale)
        meta = build(stem + ".bin")
        meta["format"] = FORMAT_VERSION
        atomic_write_json(meta_path, meta)
        written = read_meta(meta_path)
        if written is None:
            raise RuntimeError(f"token cache entry {meta_path} is inconsistent right after writing it")
        return written, True
