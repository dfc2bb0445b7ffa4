"""Which base weights an adapter job trains on. Its checkpoints hold the adapter only, so resuming one on other base
weights would silently train a different model: the identity goes into the run identity its manifest records, and
a resubmission whose base differs is refused naming both (rayspeed.train.resume_guard).

- A hub id: the revision of the cached snapshot and, per weight file, the LFS sha256 that names its blob in the
  cache (nothing is read or hashed).
- A local directory: the sha256 of each weight file, computed once and cached beside it in CACHE, keyed by size and
  modification time (a resume of a 70B adapter job does not rehash 140 GB; a directory that is not writable is
  hashed each time).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
CACHE = ".rayspeed-sha256.json"


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith(WEIGHT_SUFFIXES) and not p.name.startswith("."))


def local_digests(folder: Path) -> dict[str, str]:
    """file name -> sha256 of each weight file of `folder`, through the cache beside them."""
    cache_path = folder / CACHE
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    out, changed = {}, False
    for p in weight_files(folder):
        st = p.stat()
        key = f"{p.name}:{st.st_size}:{st.st_mtime_ns}"
        if key not in cache:
            cache[key], changed = file_sha256(p), True
        out[p.name] = cache[key]
    if changed:
        try:
            tmp = cache_path.with_name(CACHE + f".{os.getpid()}")
            tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
            tmp.replace(cache_path)
        except OSError:
            pass
    return out


def hub_digests(snapshot: Path) -> dict[str, str]:
    """file name -> LFS sha256 of each weight file of a hub cache snapshot (the name of the blob it links to)."""
    out = {}
    for p in weight_files(snapshot):
        target = Path(os.readlink(p)) if p.is_symlink() else None
        out[p.name] = target.name if target is not None else file_sha256(p)
    return out


def base_identity(ref: str, local_dir: Optional[str]) -> str:
    """One line naming the base: `sha256:<digest of the per-file digests> over N weight files` (a hub snapshot
    also names its revision). `local_dir`: where the checkpoint is on this machine (None: not there)."""
    if local_dir is None or not Path(local_dir).is_dir():
        return f"{ref} (weights not on this machine)"
    folder = Path(local_dir)
    hub = folder.parent.name == "snapshots"
    digests = hub_digests(folder) if hub else local_digests(folder)
    combined = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()[:16]
    where = f"revision {folder.name[:12]}, " if hub else ""
    return f"sha256:{combined} ({where}{len(digests)} weight files)"
