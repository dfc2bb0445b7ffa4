"""One retraining cycle at a time per job, across every host that shares the job's storage.

    lock = cycle_lock(storage, name, state_dir)   # CycleLock or S3Lock; LockUnsupported where none can hold
    with lock:                                    # raises Locked at once if another cycle holds it
        ...
        lock.check()                              # before promoting: raises LockLost if it was taken from us

- Storage on a local or shared filesystem (NFS, EFS, ...): an fcntl lock on <storage>/.retrain/<name>.lock.
  flock is released by the kernel when the holder dies, so a crashed cycle never leaves a stale lock. The lock
  file is never deleted (unlinking it would let a waiter lock an orphaned inode); it holds the holder's pid,
  host and start time for the "locked" message.
- Storage on S3 (or an S3-compatible store): the object <storage>/.retrain/<name>.lock, created with a
  conditional PUT (`If-None-Match: *`: exactly one of concurrent creators succeeds), renewed by its holder every
  ttl/3 with `If-Match: <its ETag>` and deleted the same way. A lock not renewed for `ttl_s` (its holder died)
  is taken over with `If-Match` on the stale ETag, so two waiters cannot both take it. The store is first
  checked to honour conditional writes (a second `If-None-Match: *` PUT of a probe must fail); one that ignores
  them cannot hold a lock and is refused like the stores below.
- Any other object store (gs://, abfs://, ...): LockUnsupported (the cycle exits 2): a host-local lock would let
  two hosts promote over each other.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from rayspeed.paths import is_uri

S3_SCHEMES = ("s3",)
DEFAULT_TTL_S = 600.0


class Locked(RuntimeError):
    """Another cycle holds the lock."""

    def __init__(self, path: str, holder: Optional[dict[str, Any]]):
        self.path, self.holder = path, holder or {}
        who = ""
        if self.holder:
            since = self.holder.get("started")
            age = f", for {time.time() - since:.0f} s" if isinstance(since, (int, float)) else ""
            who = f" (pid {self.holder.get('pid')} on {self.holder.get('host')}{age})"
        super().__init__(f"another retraining cycle holds {path}{who}")


class LockUnsupported(RuntimeError):
    """The storage offers no way to take a lock every host sees."""


class LockLost(RuntimeError):
    """The lock was taken over while this cycle ran (it was not renewed in time)."""


class CycleLock:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fh = None

    def check(self) -> None:
        """An flock cannot be taken from a living holder."""
        if self._fh is None:
            raise LockLost(f"{self.path} is not held")

    def acquire(self) -> "CycleLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a+")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(self.path)
            fh.close()
            raise Locked(str(self.path), holder) from None
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}))
        fh.flush()
        self._fh = fh
        return self

    def release(self) -> None:
        if self._fh is None:
            return
        try:
            self._fh.seek(0)
            self._fh.truncate()
            self._fh.flush()
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
        finally:
            self._fh.close()
            self._fh = None

    @property
    def held(self) -> bool:
        return self._fh is not None

    def __enter__(self) -> "CycleLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def read_holder(path: str | os.PathLike) -> Optional[dict[str, Any]]:
    try:
        text = Path(path).read_text().strip()
        return json.loads(text) if text else None
    except (OSError, ValueError):
        return None


def _holder(ttl_s: float, token: str) -> bytes:
    now = time.time()
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": now, "renewed": now,
                       "ttl_s": ttl_s, "token": token}).encode()


class S3Lock:
    """The lock object on S3 (see the module doc). `uri`: s3://bucket/key."""

    def __init__(self, uri: str, ttl_s: float = DEFAULT_TTL_S, client: Any = None):
        self.uri = uri
        self.bucket, _, self.key = uri.split("://", 1)[1].partition("/")
        self.ttl_s = float(ttl_s)
        self._client = client
        self._etag: Optional[str] = None
        self._token = uuid.uuid4().hex
        self._started = time.time()
        self._lost: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._mutex = threading.Lock()

    @property
    def client(self) -> Any:
        if self._client is None:
            try:
                import boto3
            except ImportError:
                raise LockUnsupported(f"{self.uri}: the retraining lock on S3 needs boto3 (pip install boto3)"
                                      ) from None
            self._client = boto3.client("s3")  # endpoint, region and credentials from the standard environment
        return self._client

    @staticmethod
    def _code(e: Exception) -> str:
        return str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))

    def _conflict(self, e: Exception) -> bool:
        return self._code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")

    def _check_conditional_writes(self) -> None:
        probe = f"{self.key}.probe-{uuid.uuid4().hex}"
        c = self.client
        c.put_object(Bucket=self.bucket, Key=probe, Body=b"probe", IfNoneMatch="*")
        try:
            c.put_object(Bucket=self.bucket, Key=probe, Body=b"probe", IfNoneMatch="*")
            honoured = False
        except Exception as e:
            if not self._conflict(e):
                raise
            honoured = True
        finally:
            c.delete_object(Bucket=self.bucket, Key=probe)
        if not honoured:
            raise LockUnsupported(f"s3://{self.bucket}: this store ignores conditional writes (If-None-Match), so "
                                  "no lock on it can keep two hosts from promoting over each other")

    def _read(self) -> tuple[Optional[dict[str, Any]], Optional[str]]:
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except Exception as e:
            if self._code(e) in ("NoSuchKey", "404"):
                return None, None
            raise
        try:
            holder = json.loads(r["Body"].read() or b"{}")
        except ValueError:
            holder = {}
        return holder, r.get("ETag")

    def acquire(self) -> "S3Lock":
        self._check_conditional_writes()
        c = self.client
        try:
            self._etag = c.put_object(Bucket=self.bucket, Key=self.key, Body=_holder(self.ttl_s, self._token),
                                      IfNoneMatch="*")["ETag"]
        except Exception as e:
            if not self._conflict(e):
                raise
            holder, etag = self._read()
            renewed = float((holder or {}).get("renewed", 0) or 0)
            ttl = float((holder or {}).get("ttl_s", self.ttl_s) or self.ttl_s)
            if holder is not None and time.time() - renewed <= ttl:
                raise Locked(self.uri, holder) from None
            try:  # stale (its holder stopped renewing it) or gone: take it over, only from that exact version
                kw = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
                self._etag = c.put_object(Bucket=self.bucket, Key=self.key, Body=_holder(self.ttl_s, self._token),
                                          **kw)["ETag"]
            except Exception as e2:
                if self._conflict(e2) or self._code(e2) in ("NoSuchKey", "404"):
                    raise Locked(self.uri, self._read()[0]) from None
                raise
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, name="rayspeed-retrain-lock", daemon=True)
        self._thread.start()
        return self

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.renew()
            except Exception:  # a transient error: the next renewal retries; check() reports a real loss
                pass

    def renew(self) -> None:
        with self._mutex:
            if self._etag is None or self._lost:
                return
            body = json.loads(_holder(self.ttl_s, self._token))
            body["started"] = self._started
            try:
                self._etag = self.client.put_object(Bucket=self.bucket, Key=self.key, Body=json.dumps(body).encode(),
                                                    IfMatch=self._etag)["ETag"]
            except Exception as e:
                if self._conflict(e) or self._code(e) in ("NoSuchKey", "404"):
                    self._lost = f"{self.uri} was taken over or removed while this cycle held it"
                else:
                    raise

    @property
    def held(self) -> bool:
        return self._etag is not None and not self._lost

    def check(self) -> None:
        """Raises LockLost when the lock is no longer ours (re-read from the store, not only remembered)."""
        if self._etag is None:
            raise LockLost(f"{self.uri} is not held")
        self.renew()
        holder, _ = self._read()
        if self._lost or (holder or {}).get("token") != self._token:
            raise LockLost(self._lost or f"{self.uri} is held by another cycle now ({holder})")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        with self._mutex:
            if self._etag is not None and not self._lost:
                try:
                    self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=self._etag)
                except Exception as e:
                    if not (self._conflict(e) or self._code(e) in ("NoSuchKey", "404")):
                        raise
            self._etag = None

    def __enter__(self) -> "S3Lock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def cycle_lock(storage: str, name: str, state_dir: Path, ttl_s: float = DEFAULT_TTL_S) -> Any:
    """The lock of job `name`'s cycles for this storage (see the module doc); LockUnsupported where none holds."""
    if not is_uri(storage):
        return CycleLock(Path(state_dir) / f"{name}.lock")
    scheme = storage.split("://", 1)[0].lower()
    if scheme in S3_SCHEMES:
        return S3Lock(f"{storage.rstrip('/')}/.retrain/{name}.lock", ttl_s)
    raise LockUnsupported(
        f"storage.path {storage}: retraining needs a lock that every host sharing this storage sees, and rayspeed "
        f"takes one only on a shared filesystem (flock) or on S3 (conditional writes); not on {scheme}://. Use an "
        "s3:// or shared-filesystem storage.path for scheduled retraining")
