"""The one interface every place a job's files live implements: a folder, addressed by a URI, that the checkpoint
protocol, the resilience records and the summaries read and write without knowing what holds it.

An implementation supplies the abstract methods; the rest (JSON, text, sha256, append) is written once here on
top of them. `commit` is the write that makes something exist (a checkpoint's manifest): durable and atomic for
readers, which is write-temp-fsync-rename on a disk and one PUT on an object store. `write_bytes` is atomic for
readers too, without the durability a commit pays for.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import IO, Any, ContextManager


class Location(ABC):
    uri: str
    """The form the caller gave (a local path or a URI); what `str()` returns."""

    # ------------------------------------------------------------ what an implementation supplies
    @abstractmethod
    def child(self, rel: str) -> "Location":
        """The location `rel` (posix, relative) under this one."""

    @abstractmethod
    def exists(self, rel: str = "") -> bool:
        """A file or a folder (a non-empty prefix on object stores) is there."""

    @abstractmethod
    def read_bytes(self, rel: str = "") -> bytes | None:
        """The file's bytes, or None when it does not exist (or cannot be read)."""

    @abstractmethod
    def write_bytes(self, rel: str, data: bytes) -> None:
        """Replace the file with `data`; readers see the old bytes or the new ones, never a mix."""

    @abstractmethod
    def commit(self, rel: str, data: bytes) -> None:
        """Write `data` as the file that makes something exist: atomic for readers and durable before it returns."""

    @abstractmethod
    def open_input(self, rel: str = "") -> ContextManager[IO[bytes]]:
        """The file as a binary stream (read in chunks: checkpoint shards do not fit in memory twice)."""

    @abstractmethod
    def size(self, rel: str = "") -> int | None:
        """Bytes of the file, None when there is none."""

    @abstractmethod
    def files(self) -> list[tuple[str, int]]:
        """(relative posix path, size) of every file under this folder, recursively, sorted."""

    @abstractmethod
    def subdirs(self) -> list[str]:
        """Names of the folders directly under this one, sorted."""

    @abstractmethod
    def delete(self, rel: str = "") -> None:
        """Remove the file or the whole folder; nothing there is not an error."""

    @abstractmethod
    def upload_dir(self, local_dir: str | Path, rel: str = "") -> list[str]:
        """Copy every file under local_dir to rel (merging with what is there); returns the relative paths."""

    @abstractmethod
    def download_dir(self, rel: str, local_dir: str | Path) -> Path:
        """Copy the folder rel into local_dir (created); returns local_dir."""

    # ------------------------------------------------------------ what every location shares
    @property
    def is_local(self) -> bool:
        """A folder of this machine's filesystem (local disk or NFS): DeepSpeed can write into it directly."""
        return False

    @property
    def is_object_store(self) -> bool:
        """No rename, a single PUT atomic for readers (S3, GCS, Azure)."""
        return False

    @property
    def local(self) -> Path:
        raise AssertionError(f"{self.uri} is not a local path")

    @property
    def handle(self) -> Any:
        """This location in the form functions taking a path return it: a Path on local disk, the URI otherwise."""
        return self.uri

    @property
    def name(self) -> str:
        return self.uri.rstrip("/").rsplit("/", 1)[-1]

    def __str__(self) -> str:
        return self.uri

    def mkdirs(self, rel: str = "") -> None:
        """Create the folder where folders exist (a no-op where folders are prefixes)."""

    def sizes(self, rels: list[str]) -> list[int | None]:
        """`size` of each of rels (implementations that can ask for many at once override this)."""
        return [self.child(rel).size() for rel in rels]

    def sha256(self, rel: str = "", chunk: int = 8 << 20) -> str:
        """sha256 of the file (streamed)."""
        h = hashlib.sha256()
        with self.open_input(rel) as fh:
            while b := fh.read(chunk):
                h.update(b)
        return h.hexdigest()

    def read_text(self, rel: str = "") -> str | None:
        data = self.read_bytes(rel)
        return None if data is None else data.decode(errors="replace")

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode())

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_bytes(rel, json.dumps(obj, indent=2, default=str).encode())

    def read_json(self, rel: str) -> dict[str, Any]:
        """{} when missing or unreadable: callers treat an absent file and a torn one alike."""
        data = self.read_bytes(rel)
        try:
            return json.loads(data) if data else {}
        except ValueError:
            return {}

    def append_jsonl(self, rel: str, record: dict[str, Any]) -> None:
        """Append one JSON line by read + rewrite (where there is no append), so one writer per file."""
        line = (json.dumps(record) + "\n").encode()
        old = b""
        if self.exists(rel):
            data = self.read_bytes(rel)
            if data is None:  # a transient read error must not rewrite the file with this line alone
                raise OSError(f"could not read {self.child(rel)} to append to it")
            old = data
        self.write_bytes(rel, old + line)

    def read_jsonl(self, rel: str) -> list[dict[str, Any]]:
        out = []
        for raw in (self.read_bytes(rel) or b"").decode(errors="replace").splitlines():
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue  # a torn last line from a crash
        return out
