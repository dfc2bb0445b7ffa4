"""A folder on a pyarrow filesystem: an object store (s3://bucket/prefix, gs://..., abfs://...), or any filesystem
pyarrow's `FileSystem.from_uri` resolves or someone else opened (Ray Train's `storage_filesystem`). The filesystem
is resolved once per root and reused for everything under it.

Object stores have no append and no rename: a file is written in one PUT (atomic for readers), which is also the
commit; other pyarrow filesystems write a temporary file and move it into place.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ContextManager

from rayspeed.storage.location import Location

# pyarrow FileSystem.type_name of object stores: a single PUT is atomic for readers, and there is no rename.
OBJECT_STORES = ("s3", "gcs", "azure", "abfs")


@dataclass(frozen=True)
class ObjectStoreLocation(Location):
    """`fs_path` inside the pyarrow filesystem `fs`; `uri` is the form the caller gave."""

    uri: str
    fs: Any = None
    fs_path: str = ""

    @property
    def is_object_store(self) -> bool:
        return self.fs.type_name in OBJECT_STORES

    def child(self, rel: str) -> "ObjectStoreLocation":
        rel = str(rel).strip("/")
        if not rel:
            return self
        return ObjectStoreLocation(f"{self.uri.rstrip('/')}/{rel}", self.fs, f"{self.fs_path.rstrip('/')}/{rel}")

    def put(self, data: bytes) -> None:
        """Write `data` as the file here: one atomic PUT on object stores, write-then-move elsewhere."""
        if self.is_object_store:
            with self.fs.open_output_stream(self.fs_path) as fh:
                fh.write(data)
            return
        parent = self.fs_path.rstrip("/").rsplit("/", 1)[0] if "/" in self.fs_path.strip("/") else ""
        if parent:
            self.fs.create_dir(parent, recursive=True)
        tmp = self.fs_path + ".tmp"
        with self.fs.open_output_stream(tmp) as fh:
            fh.write(data)
        self.fs.move(tmp, self.fs_path)

    def mkdirs(self, rel: str = "") -> None:
        if not self.is_object_store:  # object-store folders are prefixes: nothing to create
            self.fs.create_dir(self.child(rel).fs_path, recursive=True)

    def exists(self, rel: str = "") -> bool:
        from pyarrow import fs as pafs

        return self.fs.get_file_info(self.child(rel).fs_path).type != pafs.FileType.NotFound

    def read_bytes(self, rel: str = "") -> bytes | None:
        try:
            with self.fs.open_input_stream(self.child(rel).fs_path) as fh:
                return fh.read()
        except OSError:
            return None

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.child(rel).put(data)

    def commit(self, rel: str, data: bytes) -> None:
        self.child(rel).put(data)

    def open_input(self, rel: str = "") -> ContextManager[IO[bytes]]:
        return self.fs.open_input_stream(self.child(rel).fs_path)

    def size(self, rel: str = "") -> int | None:
        return self.sizes([rel])[0]

    def sizes(self, rels: list[str]) -> list[int | None]:
        """One listing request for all of them."""
        from pyarrow import fs as pafs

        infos = self.fs.get_file_info([self.child(rel).fs_path for rel in rels])
        return [int(i.size) if i.type == pafs.FileType.File else None for i in infos]

    def files(self) -> list[tuple[str, int]]:
        from pyarrow import fs as pafs

        base = self.fs_path.rstrip("/") + "/"
        out = []
        for info in self.fs.get_file_info(pafs.FileSelector(self.fs_path, recursive=True, allow_not_found=True)):
            if info.type == pafs.FileType.File and info.path.startswith(base):
                out.append((info.path[len(base):], int(info.size)))
        return sorted(out)

    def subdirs(self) -> list[str]:
        from pyarrow import fs as pafs

        return sorted(info.path.rstrip("/").rsplit("/", 1)[-1]
                      for info in self.fs.get_file_info(pafs.FileSelector(self.fs_path, allow_not_found=True))
                      if info.type == pafs.FileType.Directory)

    def delete(self, rel: str = "") -> None:
        from pyarrow import fs as pafs

        loc = self.child(rel)
        info = loc.fs.get_file_info(loc.fs_path)
        if info.type == pafs.FileType.Directory:
            loc.fs.delete_dir(loc.fs_path)
        elif info.type == pafs.FileType.File:
            loc.fs.delete_file(loc.fs_path)

    def upload_dir(self, local_dir: str | Path, rel: str = "") -> list[str]:
        from pyarrow import fs as pafs

        local_dir = Path(local_dir)
        dest = self.child(rel)
        files = sorted(str(p.relative_to(local_dir)) for p in local_dir.rglob("*") if p.is_file())
        if not dest.is_object_store:
            dest.fs.create_dir(dest.fs_path, recursive=True)
        # pyarrow's copy_files streams each file with a thread pool (multipart uploads on S3).
        pafs.copy_files(str(local_dir), dest.fs_path, source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=dest.fs, use_threads=True)
        return files

    def download_dir(self, rel: str, local_dir: str | Path) -> Path:
        from pyarrow import fs as pafs

        src = self.child(rel)
        local_dir = Path(local_dir)
        local_dir.mkdir(parents=True, exist_ok=True)
        pafs.copy_files(src.fs_path, str(local_dir), source_filesystem=src.fs,
                        destination_filesystem=pafs.LocalFileSystem(), use_threads=True)
        return local_dir


# Filesystems resolved from URIs, by the URI they were resolved for: a URI under one of them reuses its filesystem
# (one S3 region lookup per root; one in-memory filesystem for every mock:// path under a root).
RESOLVED: dict[str, tuple[Any, str]] = {}


def resolve_uri(uri: str) -> ObjectStoreLocation:
    scheme, sep, rest = uri.partition("://")
    uri = scheme + sep + rest.rstrip("/")
    best = None
    for known in RESOLVED:
        if (uri == known or uri.startswith(known.rstrip("/") + "/")) and (best is None or len(known) > len(best)):
            best = known
    if best is not None:
        fs, fs_path = RESOLVED[best]
        return ObjectStoreLocation(best, fs, fs_path).child(uri[len(best):])
    from pyarrow import fs as pafs

    fs, fs_path = pafs.FileSystem.from_uri(uri)
    RESOLVED[uri] = (fs, fs_path)
    return ObjectStoreLocation(uri, fs, fs_path)
