"""One retraining cycle at a time per job: an fcntl lock on <state dir>/<name>.lock.

    with CycleLock(path) as lock:       # raises Locked at once if another cycle holds it
        ...

flock is released by the kernel when the holder dies, so a crashed cycle never leaves a stale lock. The lock
file is never deleted (unlinking it would let a waiter lock an orphaned inode); it holds the holder's pid,
host and start time for the "locked" message.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Optional


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


class CycleLock:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fh = None

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
