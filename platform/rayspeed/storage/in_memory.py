"""A location held in this process's memory: `memory://<store>/<path>`, a dict of bytes. Folders are prefixes, as on
an object store, and every write is atomic (one dict assignment), so a commit is a write. Nothing survives the
process: it is for tests, and it is the proof that the Location interface is all the checkpoint protocol needs."""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, ContextManager

from rayspeed.storage.location import Location

SCHEME = "memory://"

# Every memory:// file of the process, by its path after the scheme; the lock keeps listings consistent while the
# background checkpoint writer and the training thread both use it.
BLOBS: dict[str, bytes] = {}
LOCK = threading.Lock()


@dataclass(frozen=True)
class MemoryLocation(Location):
    uri: str

    @property
    def key(self) -> str:
        return self.uri[len(SCHEME):].strip("/")

    def child(self, rel: str) -> "MemoryLocation":
        rel = str(rel).strip("/")
        return self if not rel else MemoryLocation(f"{self.uri.rstrip('/')}/{rel}")

    def under(self) -> dict[str, bytes]:
        """The files under this folder, by their path relative to it."""
        base = self.key + "/"
        with LOCK:
            return {k[len(base):]: v for k, v in BLOBS.items() if k.startswith(base)}

    def exists(self, rel: str = "") -> bool:
        loc = self.child(rel)
        with LOCK:
            if loc.key in BLOBS:
                return True
        return bool(loc.under())

    def read_bytes(self, rel: str = "") -> bytes | None:
        with LOCK:
            return BLOBS.get(self.child(rel).key)

    def write_bytes(self, rel: str, data: bytes) -> None:
        with LOCK:
            BLOBS[self.child(rel).key] = bytes(data)

    def commit(self, rel: str, data: bytes) -> None:
        self.write_bytes(rel, data)

    def open_input(self, rel: str = "") -> ContextManager[IO[bytes]]:
        data = self.read_bytes(rel)
        if data is None:
            raise FileNotFoundError(self.child(rel).uri)
        return io.BytesIO(data)

    def size(self, rel: str = "") -> int | None:
        data = self.read_bytes(rel)
        return None if data is None else len(data)

    def files(self) -> list[tuple[str, int]]:
        return sorted((rel, len(data)) for rel, data in self.under().items())

    def subdirs(self) -> list[str]:
        return sorted({rel.split("/", 1)[0] for rel in self.under() if "/" in rel})

    def delete(self, rel: str = "") -> None:
        loc = self.child(rel)
        base = loc.key + "/"
        with LOCK:
            for k in [k for k in BLOBS if k == loc.key or k.startswith(base)]:
                del BLOBS[k]

    def upload_dir(self, local_dir: str | Path, rel: str = "") -> list[str]:
        local_dir, dest = Path(local_dir), self.child(rel)
        files = sorted(str(p.relative_to(local_dir).as_posix()) for p in local_dir.rglob("*") if p.is_file())
        for f in files:
            dest.write_bytes(f, (local_dir / f).read_bytes())
        return files

    def download_dir(self, rel: str, local_dir: str | Path) -> Path:
        local_dir = Path(local_dir)
        local_dir.mkdir(parents=True, exist_ok=True)
        for f, data in self.child(rel).under().items():
            (local_dir / f).parent.mkdir(parents=True, exist_ok=True)
            (local_dir / f).write_bytes(data)
        return local_dir
