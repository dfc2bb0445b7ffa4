"""The token cache's small tools: content keys, temporary names, atomic JSON, a per-entry lock, and the
"build once, reuse everywhere" protocol every cached corpus uses.

An entry is complete once its meta file exists: it is written last, atomically (temp file + os.replace), after
the data it describes. Builders hold an fcntl lock on the entry's lock file, so several processes on one machine
build an entry once (flock is per machine: on a shared filesystem each node builds under its own lock, which is
still safe because of the atomic rename, just redundant). The lock file is removed when the build ends, and a
build that fails removes the folders it made: bad input leaves the cache as it found it.

    with discard_on_bad_input():        # the launcher's data step
        ...build entries, check them...  # a ConfigError removes what was committed inside, then propagates
"""

from __future__ import annotations

import fcntl
import glob as _glob
import hashlib
import json
import os
import secrets
import shutil
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Optional

import numpy as np

from rayspeed.errors import ConfigError

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


# What the launcher's data step has written, while discard_on_bad_input is active: ("entry", path) for a committed
# cache entry, ("dir", path) for a folder made to hold one.
_WRITTEN: ContextVar[Optional[list[tuple[str, str]]]] = ContextVar("rayspeed_data_written", default=None)


def note_written(kind: str, *paths: str) -> None:
    notes = _WRITTEN.get()
    if notes is not None:
        notes += [(kind, p) for p in paths]


def _mkdir_p(path: str, made: list[str]) -> None:
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent != path:
        _mkdir_p(parent, made)
    try:
        os.mkdir(path)
    except FileExistsError:  # made by another process meanwhile: not ours to remove
        return
    made.append(path)


def make_dirs(path: str) -> list[str]:
    """os.makedirs(path), returning the folders this call made, outermost first (so that they can be removed again:
    a folder another process made at the same time is not in the list)."""
    made: list[str] = []
    try:
        for _ in range(8):  # a failed build elsewhere may remove a parent just made: make it again
            try:
                _mkdir_p(os.path.abspath(path), made)
                break
            except FileNotFoundError:
                continue
        os.makedirs(path, exist_ok=True)  # raises what makedirs says when path cannot be a folder
    except OSError:
        remove_empty_dirs(made)
        raise
    note_written("dir", *made)
    return made


def remove_empty_dirs(made: list[str]) -> None:
    for d in reversed(made):
        try:
            os.rmdir(d)
        except FileNotFoundError:  # removed by another failed build
            continue
        except OSError:  # not empty: another builder's entry is in it
            return


@contextmanager
def building(cache_dir: str, name: str) -> Iterator[None]:
    """The build lock of one cache entry: <cache_dir>/<name>.lock, made (with the folder) when missing and held with
    flock. The holder removes the file before it lets go, so no lock file outlives a build; a waiter that then gets
    the removed file's lock takes the lock again (the entry is there by then, or the build failed). A failed build
    also removes the folders made for it while they are empty: bad input leaves nothing behind."""
    path = os.path.join(cache_dir, name + ".lock")
    while True:
        made = make_dirs(cache_dir)
        try:
            # Opened for writing: NFS refuses an exclusive flock on a file opened read-only.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        except FileNotFoundError:  # a failed build removed the folder in between
            continue
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    failed = True
    try:
        yield
        failed = False
    finally:
        try:
            os.unlink(path)  # while still held: whoever waits on this file sees it gone and starts over
        except FileNotFoundError:
            pass
        if failed:  # while still held too: a waiter then finds the folders gone and makes (and removes) its own
            remove_empty_dirs(made)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        if failed:  # again: on NFS the removed lock file stays (as .nfsXXXX) until closed, keeping its folder
            remove_empty_dirs(made)


@contextmanager
def discard_on_bad_input() -> Iterator[None]:
    """Cache entries committed inside (and the folders made for them) are removed again when a ConfigError leaves
    it: a check that needs the tokens (too few for one validation batch, an id past the model's vocabulary) fails
    after the build, and bad input must leave nothing written."""
    notes: list[tuple[str, str]] = []
    token = _WRITTEN.set(notes)
    try:
        yield
    except ConfigError:
        for kind, path in reversed(notes):
            if kind == "dir":
                remove_empty_dirs([path])
            elif os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.lexists(path):
                os.unlink(path)
        raise
    finally:
        _WRITTEN.reset(token)


def cached(cache_dir: str, key: str, build: Callable[[str], dict]) -> tuple[dict, bool]:
    """Return (meta, built). build(bin_path) writes the data (atomically) and returns its meta."""
    stem = os.path.join(cache_dir, f"tokens-{key}")
    meta_path = stem + ".json"
    meta = read_meta(meta_path)  # fast path, no lock: the meta file appears only once complete
    if meta is not None:
        return meta, False
    with building(cache_dir, f"tokens-{key}"):
        meta = read_meta(meta_path)  # another process built it while we waited
        if meta is not None:
            return meta, False
        # Only the lock holder writes temp files for this key, so any left are from a crashed builder.
        for stale in _glob.glob(_glob.escape(stem) + ".*.tmp"):
            os.unlink(stale)
        meta = build(stem + ".bin")
        meta["format"] = FORMAT_VERSION
        atomic_write_json(meta_path, meta)
        # The .bin only when the build wrote it: a .bin used in place is the user's file, recorded by its path.
        note_written("entry", meta_path, *([stem + ".bin"] if os.path.exists(stem + ".bin") else []))
        written = read_meta(meta_path)
        if written is None:
            raise RuntimeError(f"token cache entry {meta_path} is inconsistent right after writing it")
        return written, True
