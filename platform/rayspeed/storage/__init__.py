"""Where a job's files live: a local/NFS path, an object-store URI (s3://bucket/prefix, gs://..., anything pyarrow's
`FileSystem.from_uri` and Ray Train's storage_path accept) or memory:// (this process; tests), behind one interface
(`Location`, storage/location.py) with one module per kind: local_disk.py, object_store.py, in_memory.py.

    loc = locate("s3://bucket/runs").child("my-job")     # the filesystem is resolved once per root
    loc.write_json("summary.json", {...}); loc.read_json("summary.json"); loc.exists(".chaos/x")
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

import os
from pathlib import Path
from typing import Any

from rayspeed.paths import is_uri
from rayspeed.storage.in_memory import SCHEME as MEMORY_SCHEME
from rayspeed.storage.in_memory import MemoryLocation
from rayspeed.storage.local_disk import LocalLocation
from rayspeed.storage.location import Location
from rayspeed.storage.object_store import OBJECT_STORES, ObjectStoreLocation, resolve_uri

__all__ = ["DRIVER_ONLY_ENV", "OBJECT_STORES", "STORAGE_ENV_PREFIXES", "LocalLocation", "Location",
           "MemoryLocation", "ObjectStoreLocation", "at", "check_reachable", "forwarded_env", "local_path",
           "local_write_problem", "locate", "resolve"]

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


def local_path(path: Any) -> Path:
    """A local path from a str, Path or file:// URI."""
    if isinstance(path, str) and path.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(path).path))
    return Path(path)


def resolve(path: Any, filesystem: Any = None) -> Location | None:
    """Where `path` is when it is not a local path (a URI, or a path inside `filesystem`); None for a local path."""
    if filesystem is not None:
        p = str(path)
        return ObjectStoreLocation(p, filesystem, p)
    if is_uri(path):
        p = str(path)
        return MemoryLocation(p.rstrip("/")) if p.startswith(MEMORY_SCHEME) else resolve_uri(p)
    return None


def locate(path: str | Path | Location) -> Location:
    """A local path (str, Path or file:// URI) or any URI pyarrow resolves; the filesystem is resolved once per root."""
    if isinstance(path, Location):
        return path
    remote = resolve(path)
    return remote if remote is not None else LocalLocation(str(local_path(path)))


def at(path: str | Path | Location, filesystem: Any = None) -> Location:
    """`locate`, or the path inside `filesystem` when one is given (the form the checkpoint functions take)."""
    return locate(path) if filesystem is None else ObjectStoreLocation(str(path), filesystem, str(path))


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
    if not isinstance(loc, ObjectStoreLocation):  # memory:// is always there
        return None
    from pyarrow import fs as pafs

    bucket = loc.fs_path.strip("/").split("/", 1)[0]
    try:
        info = loc.fs.get_file_info(bucket if loc.is_object_store else loc.fs_path)
    except Exception as e:
        return (f"{key}: the bucket of {path!r} cannot be reached ({str(e).splitlines()[0][:300]}); check the "
                "endpoint (AWS_ENDPOINT_URL), network and credentials, or use a local absolute path")
    if loc.is_object_store and info.type == pafs.FileType.NotFound:
        return f"{key}: bucket {bucket!r} of {path!r} does not exist; create it or fix the bucket name"
    return None
