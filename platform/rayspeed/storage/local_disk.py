"""A folder on this machine's filesystem (local disk or NFS): plain file I/O, the fast path (no pyarrow, no
copies). Writes go to a temporary name and are renamed into place; a commit also fsyncs the file and its folder, so
what it names survives a crash of the machine."""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ContextManager

from rayspeed.storage.location import Location


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (best effort: some filesystems cannot open a folder)."""
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


@dataclass(frozen=True)
class LocalLocation(Location):
    uri: str

    @property
    def is_local(self) -> bool:
        return True

    @property
    def local(self) -> Path:
        return Path(self.uri)

    @property
    def handle(self) -> Any:
        return Path(self.uri)

    def child(self, rel: str) -> "LocalLocation":
        rel = str(rel).strip("/")
        return self if not rel else LocalLocation(str(Path(self.uri) / rel))

    def path(self, rel: str = "") -> Path:
        return Path(self.child(rel).uri)

    def mkdirs(self, rel: str = "") -> None:
        self.path(rel).mkdir(parents=True, exist_ok=True)

    def exists(self, rel: str = "") -> bool:
        return self.path(rel).exists()

    def read_bytes(self, rel: str = "") -> bytes | None:
        try:
            return self.path(rel).read_bytes()
        except OSError:
            return None

    def write_bytes(self, rel: str, data: bytes) -> None:
        p = self.path(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, p)

    def commit(self, rel: str, data: bytes) -> None:
        p = self.path(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
        fsync_dir(p.parent)

    def open_input(self, rel: str = "") -> ContextManager[IO[bytes]]:
        return open(self.path(rel), "rb")

    def size(self, rel: str = "") -> int | None:
        p = self.path(rel)
        return p.stat().st_size if p.is_file() else None

    def files(self) -> list[tuple[str, int]]:
        root = Path(self.uri)
        out = []
        for p in root.rglob("*"):
            try:
                st = p.stat()
            except FileNotFoundError:  # another writer's temp file, renamed into place since the listing
                continue
            if stat.S_ISREG(st.st_mode):
                out.append((str(p.relative_to(root).as_posix()), st.st_size))
        return sorted(out)

    def subdirs(self) -> list[str]:
        root = Path(self.uri)
        return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []

    def delete(self, rel: str = "") -> None:
        p = self.path(rel)
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.exists():
            os.remove(p)

    def append_jsonl(self, rel: str, record: dict[str, Any]) -> None:
        """One O_APPEND write, fsynced: concurrent writers do not interleave."""
        import json

        p = self.path(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def upload_dir(self, local_dir: str | Path, rel: str = "") -> list[str]:
        local_dir, dest = Path(local_dir), self.path(rel)
        files = sorted(str(p.relative_to(local_dir)) for p in local_dir.rglob("*") if p.is_file())
        for f in files:
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(local_dir / f, dest / f)
        return files

    def download_dir(self, rel: str, local_dir: str | Path) -> Path:
        local_dir = Path(local_dir)
        local_dir.mkdir(parents=True, exist_ok=True)
        shutil.copytree(self.path(rel), local_dir, dirs_exist_ok=True)
        return local_dir
