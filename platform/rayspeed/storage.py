"""Where a job's files live: a local/NFS path or an object-store URI (s3://bucket/prefix, gs://..., anything
pyarrow's `FileSystem.from_uri` and Ray Train's storage_path accept), behind one small interface.

    loc = locate("s3://bucket/runs").child("my-job")     # the filesystem is resolved once per root
    loc.write_json("summary.json", {...}); loc.read_json("worker_result.json"); loc.exists(".chaos/x")
    loc.upload_dir(local_dir, "checkpoint_step00000010"); loc.download_dir("checkpoint_step00000010", local_dir)

A local path takes plain file I/O (the fast path: no pyarrow, no copies). A URI goes through a pyarrow filesystem
resolved once per root and reused for everything under it, so checkpoints, manifests, summaries and resilience
events all share one filesystem object per root; `resolve(path, filesystem=...)` also wraps a filesystem someone
else opened (Ray Train's `storage_filesystem` with its `experiment_fs_path`).

Object stores have no append and no rename: a JSON file is written in one PUT (atomic for readers), and
`append_jsonl` rewrites the whole (small) object. That is safe only with a single writer per file, which is
how rayspeed uses it (events.jsonl: the Ray Train controller; handled.jsonl and progress.json: rank 0).

Credentials and endpoints come from the environment the way pyarrow and the cloud SDKs read them
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, GOOGLE_APPLICATION_CREDENTIALS, ...);
`forwarded_env` lists the ones the launcher hands to the Ray workers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayspeed.paths import is_uri

# pyarrow FileSystem.type_name of object stores: a single PUT is atomic for readers, and there is no rename.
OBJECT_STORES = ("s3", "gcs", "azure", "abfs")

# Read by pyarrow / the AWS, GCS and Azure SDKs. A driver that reaches the bucket with these must hand them to
# the workers (the Ray Train controller and workers run in processes the driver did not start).
STORAGE_ENV_PREFIXES = ("AWS_", "GOOGLE_", "GCS_", "AZURE_", "ARROW_S3_")


# Values that name something on the driver's machine (a profile, a file): on another node they point at
# nothing, or at something else, and would break nodes that authenticate with their own role.
DRIVER_ONLY_ENV = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
                   "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CA_BUNDLE", "GOOGLE_APPLICATION_CREDENTIALS")


def forwarded_env(environ: dict[str, str] | None = None, remote: bool = False) -> dict[str, str]:
    """The storage variables the Ray Train controller and workers get. `remote`: the cluster's nodes are other
    machines, so profile and file-path variables stay behind (put those files on the nodes, or use node roles)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items()
            if k.startswith(STORAGE_ENV_PREFIXES) and not (remote and k in DRIVER_ONLY_ENV)}


@dataclass(frozen=True)
class Location:
    """A folder on local disk (`fs` None) or on a pyarrow filesystem (`fs_path` inside `fs`); `uri` is the form
    the caller gave (a local path or a URI) and is what `str()` returns."""

    uri: str
    fs: Any = None
    fs_path: str = ""

    @property
    def is_local(self) -> bool:
        return self.fs is None

    @property
    def local(self) -> Path:
        assert self.fs is None, f"{self.uri} is not a local path"
        return Path(self.uri)

    @property
    def name(self) -> str:
        return self.uri.rstrip("/").rsplit("/", 1)[-1]

    @property
    def is_object_store(self) -> bool:
        return self.fs is not None and self.fs.type_name in OBJECT_STORES

    def __str__(self) -> str:
        return self.uri

    # ------------------------------------------------------------ the file at this location (remote only)
    def put(self, data: bytes) -> None:
        """Commit `data` here: one atomic PUT on object stores, write-then-move on other remote filesystems."""
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

    def sha256(self, chunk: int = 8 << 20) -> str:
        """sha256 of the file here (streamed)."""
        h = hashlib.sha256()
        if self.fs is None:
            with open(self.uri, "rb") as fh:
                while b := fh.read(chunk):
                    h.update(b)
        else:
            with self.fs.open_input_stream(self.fs_path) as fh:
                while b := fh.read(chunk):
                    h.update(b)
        return h.hexdigest()

    def size(self) -> int | None:
        """Bytes of the file here, None when there is none."""
        if self.fs is None:
            return os.path.getsize(self.uri) if os.path.isfile(self.uri) else None
        from pyarrow import fs as pafs

        info = self.fs.get_file_info(self.fs_path)
        return int(info.size) if info.type == pafs.FileType.File else None

    def files(self) -> list[tuple[str, int]]:
        """(relative posix path, size) of every file under this folder, recursively, sorted."""
        if self.fs is None:
            root = Path(self.uri)
            return sorted((str(p.relative_to(root).as_posix()), p.stat().st_size)
                          for p in root.rglob("*") if p.is_file())
        from pyarrow import fs as pafs

        base = self.fs_path.rstrip("/") + "/"
        out = []
        for info in self.fs.get_file_info(pafs.FileSelector(self.fs_path, recursive=True, allow_not_found=True)):
            if info.type == pafs.FileType.File and info.path.startswith(base):
                out.append((info.path[len(base):], int(info.size)))
        return sorted(out)

    def subdirs(self) -> list[str]:
        """Names of the folders directly under this one."""
        if self.fs is None:
            root = Path(self.uri)
            return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        from pyarrow import fs as pafs

        return sorted(info.path.rstrip("/").rsplit("/", 1)[-1]
                      for info in self.fs.get_file_info(pafs.FileSelector(self.fs_path, allow_not_found=True))
                      if info.type == pafs.FileType.Directory)

    def child(self, rel: str) -> "Location":
        rel = str(rel).strip("/")
        if not rel:
            return self
        if self.fs is None:
            return Location(str(Path(self.uri) / rel))
        return Location(f"{self.uri.rstrip('/')}/{rel}", self.fs, f"{self.fs_path.rstrip('/')}/{rel}")

    # ------------------------------------------------------------ small files
    def mkdirs(self, rel: str = "") -> None:
        """Create the folder (local) or its marker (a no-op on object stores, where folders are prefixes)."""
        loc = self.child(rel)
        if loc.fs is None:
            Path(loc.uri).mkdir(parents=True, exist_ok=True)
        elif loc.fs.type_name not in OBJECT_STORES:
            loc.fs.create_dir(loc.fs_path, recursive=True)

    def exists(self, rel: str = "") -> bool:
        loc = self.child(rel)
        if loc.fs is None:
            return os.path.exists(loc.uri)
        from pyarrow import fs as pafs

        return loc.fs.get_file_info(loc.fs_path).type != pafs.FileType.NotFound

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Atomic for readers: write-then-rename locally, one PUT (or tmp + move) on a pyarrow filesystem."""
        loc = self.child(rel)
        if loc.fs is None:
            p = Path(loc.uri)
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(p.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, p)
            return
        loc.put(data)

    def read_bytes(self, rel: str = "") -> bytes | None:
        """The file's bytes, or None when it does not exist (or cannot be read)."""
        loc = self.child(rel)
        try:
            if loc.fs is None:
                return Path(loc.uri).read_bytes()
            with loc.fs.open_input_stream(loc.fs_path) as fh:
                return fh.read()
        except OSError:
            return None

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
        """Append one JSON line. Local: one O_APPEND write (concurrent writers do not interleave). Remote:
        read + rewrite, so one writer per file."""
        line = (json.dumps(record) + "\n").encode()
        loc = self.child(rel)
        if loc.fs is None:
            p = Path(loc.uri)
            p.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
            return
        old = b""
        if self.exists(rel):
            data = self.read_bytes(rel)
            if data is None:  # a transient read error must not rewrite the file with this line alone
                raise OSError(f"could not read {loc} to append to it")
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

    def delete(self, rel: str = "") -> None:
        loc = self.child(rel)
        if loc.fs is None:
            if os.path.isdir(loc.uri):
                shutil.rmtree(loc.uri, ignore_errors=True)
            elif os.path.exists(loc.uri):
                os.remove(loc.uri)
            return
        from pyarrow import fs as pafs

        info = loc.fs.get_file_info(loc.fs_path)
        if info.type == pafs.FileType.Directory:
            loc.fs.delete_dir(loc.fs_path)
        elif info.type == pafs.FileType.File:
            loc.fs.delete_file(loc.fs_path)

    # ------------------------------------------------------------ whole folders
    def upload_dir(self, local_dir: str | Path, rel: str = "") -> list[str]:
        """Copy every file under local_dir to rel (merging with what is there); returns the relative paths."""
        local_dir = Path(local_dir)
        dest = self.child(rel)
        files = sorted(str(p.relative_to(local_dir)) for p in local_dir.rglob("*") if p.is_file())
        if dest.fs is None:
            for f in files:
                (dest.local / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(local_dir / f, dest.local / f)
            return files
        from pyarrow import fs as pafs

        if dest.fs.type_name not in OBJECT_STORES:
            dest.fs.create_dir(dest.fs_path, recursive=True)
        # pyarrow's copy_files streams each file with a thread pool (multipart uploads on S3).
        pafs.copy_files(str(local_dir), dest.fs_path, source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=dest.fs, use_threads=True)
        return files

    def download_dir(self, rel: str, local_dir: str | Path) -> Path:
        """Copy the folder rel into local_dir (created); returns local_dir."""
        src = self.child(rel)
        local_dir = Path(local_dir)
        local_dir.mkdir(parents=True, exist_ok=True)
        if src.fs is None:
            shutil.copytree(src.local, local_dir, dirs_exist_ok=True)
            return local_dir
        from pyarrow import fs as pafs

        pafs.copy_files(src.fs_path, str(local_dir), source_filesystem=src.fs,
                        destination_filesystem=pafs.LocalFileSystem(), use_threads=True)
        return local_dir


def local_path(path: Any) -> Path:
    """A local path from a str, Path or file:// URI."""
    if isinstance(path, str) and path.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(path).path))
    return Path(path)


# Filesystems resolved from URIs, by the URI they were resolved for: a URI under one of them reuses its filesystem
# (one S3 region lookup per root; one in-memory filesystem for every mock:// path under a root).
_RESOLVED: dict[str, tuple[Any, str]] = {}


def _resolve_uri(uri: str) -> Location:
    scheme, sep, rest = uri.partition("://")
    uri = scheme + sep + rest.rstrip("/")
    best = None
    for known in _RESOLVED:
        if (uri == known or uri.startswith(known.rstrip("/") + "/")) and (best is None or len(known) > len(best)):
            best = known
    if best is not None:
        fs, fs_path = _RESOLVED[best]
        return Location(best, fs, fs_path).child(uri[len(best):])
    from pyarrow import fs as pafs

    fs, fs_path = pafs.FileSystem.from_uri(uri)
    _RESOLVED[uri] = (fs, fs_path)
    return Location(uri, fs, fs_path)


def resolve(path: Any, filesystem: Any = None) -> Location | None:
    """Where `path` is on its pyarrow filesystem (a URI, or a path inside `filesystem`); None for a local path."""
    if filesystem is not None:
        p = str(path)
        return Location(p, filesystem, p)
    if is_uri(path):
        return _resolve_uri(str(path))
    return None


def locate(path: str | Path | Location) -> Location:
    """A local path (str, Path or file:// URI) or any URI pyarrow resolves; the filesystem is resolved once per root."""
    if isinstance(path, Location):
        return path
    remote = resolve(path)
    return remote if remote is not None else Location(str(local_path(path)))


def local_write_problem(path: str, key: str = "storage.path") -> str | None:
    """None when this process can create and write `path` (a local or NFS folder); else one line naming the key.
    Probes with a temporary folder in the nearest existing ancestor and removes it: nothing is left behind."""
    import tempfile

    p = local_path(path).expanduser()
    ancestor = p
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{key}: {ancestor} (on the way to {p}) is a file, not a folder; choose another path"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rayspeed-probe-", dir=ancestor))
    except OSError as e:
        return (f"{key}: cannot write to {p} ({e.strerror} in {ancestor}); choose a folder this user can write, "
                "or fix its permissions")
    return None


def check_reachable(path: str, key: str = "storage.path") -> str | None:
    """None when `path` is local or its bucket answers; else one line naming the key and the fix. Writes nothing."""
    if not is_uri(path):
        return local_write_problem(path, key)
    scheme = path.split("://", 1)[0]
    try:
        loc = locate(path)
    except Exception as e:  # pyarrow: ArrowInvalid for an unknown scheme, OSError for a missing bucket/region
        msg = str(e).splitlines()[0][:300]
        if "Unrecognized filesystem type" in msg or "not supported" in msg.lower():
            return (f"{key}: {path!r} has a scheme ({scheme}://) no filesystem handles; use a local absolute path "
                    "or an object-store URI such as s3://bucket/prefix, gs://bucket/prefix or abfs://container/prefix")
        return (f"{key}: cannot open {path!r} ({msg}); check the bucket name, the credentials and endpoint in the "
                "environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...)")
    from pyarrow import fs as pafs

    bucket = loc.fs_path.strip("/").split("/", 1)[0]
    try:
        info = loc.fs.get_file_info(bucket if loc.fs.type_name in OBJECT_STORES else loc.fs_path)
    except Exception as e:
        return (f"{key}: the bucket of {path!r} cannot be reached ({str(e).splitlines()[0][:300]}); check the "
                "endpoint (AWS_ENDPOINT_URL), network and credentials, or use a local absolute path")
    if loc.fs.type_name in OBJECT_STORES and info.type == pafs.FileType.NotFound:
        return f"{key}: bucket {bucket!r} of {path!r} does not exist; create it or fix the bucket name"
    return None
