"""The rank-zero MLflow logger.

Gate once (only rank 0 constructs a live logger; other ranks get a no-op), import mlflow lazily, and
never let the tracking server stall or kill training: everything goes through a queue drained by one
background thread that retries with backoff, warns once while the server is away and flushes when it
is back. Params, tags and text artifacts are redacted on the way in (rayspeed.redact): a secret in the config
(cluster.env), a tracking URI with credentials or a token in a report never reaches the tracking server.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import threading
import time
from typing import Any, Callable, Optional

from rayspeed.redact import redact_mapping, redact_text

log = logging.getLogger(__name__)

_MAX_BATCH = 500  # MLflow's log_batch limit is 1000 metrics; stay well under.
# Metrics leave in one request at most this often. One log_batch per log step (twice a second on the CPU
# demo) kept rank 0's logger thread at 3% of a core in SQLAlchemy commits, time the other ranks then wait
# for at the next all-reduce; a server shared by many jobs prefers fewer, larger requests too. The worker
# flushes when training raises (a peer died), so only a hard kill of rank 0 itself can lose the last
# interval's metrics, and those steps are re-run and re-logged after the restart.
METRICS_EVERY_S = 2.0


class NullLogger:
    """What non-zero ranks get: every call is free."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_artifact_file(self, path: str, artifact_path: str | None = None) -> None:
        pass

    def resend(self, kind: str, payload: Any) -> None:
        """A record as the queue holds it (metrics, params, tags, text): what the spool kept of an earlier logger."""
        self._put(kind, [tuple(m) for m in payload] if kind == "metrics" else
                  tuple(payload) if kind == "text" else payload)

    def log_artifact_dir(self, path: str, artifact_path: str | None = None, remove: bool = False) -> None:
        if remove:
            shutil.rmtree(path, ignore_errors=True)

    def flush(self, timeout_s: float = 60.0) -> bool:
        return True

    def deliver(self, timeout_s: float = 60.0) -> bool:
        return True

    def close(self, timeout_s: float = 60.0) -> None:
        pass

    def last_step(self, key: str) -> int:
        return 0


# deliver() waits for the queue to empty, but not for a server that is away: it returns once a send failed (the queue
# keeps the records and delivers them when the server answers). Waiting for it instead cost a job with the tracking
# server down 5 s at each checkpoint and 75 s at its end (94 s from command to exit for a 2-step job).
AWAY_POLL_S = 0.1
# A job whose server never answered gives a late one this long at its end (rayspeed.train.outputs), retrying at least
# every WAITED_RETRY_S while it waits: a server that comes up by then gets the run and every record (the old wait
# was 60 + 15 s, and a retry could sleep 30 s of backoff through a server that was already up).
LATE_SERVER_S = 30.0
WAITED_RETRY_S = 1.0
# At close, with records undelivered: how long the send in flight may take to fail (MLFLOW_HTTP_REQUEST_TIMEOUT is
# 10 s here) before the rest are written to the spool.
SPOOL_JOIN_S = 15.0


class MlflowLogger(NullLogger):
    def last_step(self, key: str) -> int:
        """The highest step `key` was logged at in this run so far (0 when none, or when the server is away)."""
        if self.run_id is None:
            return 0
        try:
            return max((int(m.step) for m in self.client.get_metric_history(self.run_id, key)), default=0)
        except Exception as e:  # tracking never blocks training: at worst a replayed step is logged twice
            log.warning("MLflow: could not read the history of %s (%s)", key, _short(e))
            return 0

    def __init__(self, tracking_uri: str, run_id: Optional[str], retry_max_s: float = 30.0,
                 metrics_every_s: float = METRICS_EVERY_S, run_factory: Optional[Callable[[], str]] = None,
                 on_run: Optional[Callable[[str], None]] = None,
                 spool: Optional[Callable[[Optional[str], list[tuple[str, Any]]], tuple[str, int]]] = None):
        """run_id None with a run_factory: the run does not exist yet (the server did not answer at launch);
        the queue's thread calls run_factory, retrying like any record, before it sends the first one, then
        on_run(run_id). Everything logged meanwhile waits in the queue. spool(run_id, records) -> (where, kept):
        what keeps the records still undelivered at close (rayspeed.tracking.spool.write_spool, bound to the
        experiment folder) for the job's next launch to deliver."""
        # Short HTTP retries inside mlflow: our own loop retries forever without blocking the caller.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self._tracking_uri = tracking_uri
        self._client: Any = None
        self._client_lock = threading.Lock()
        self.run_id = run_id
        self._run_factory = run_factory
        self._on_run = on_run
        self._q: "queue.Queue[tuple[str, Any]]" = queue.Queue()
        self._retry_max_s = retry_max_s
        self._warned = False
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._flush_now = threading.Event()  # cuts the metrics coalescing wait short
        self._wake = threading.Event()  # cuts a retry's backoff short when someone starts waiting
        self._waiters = 0
        self._metrics_every_s = metrics_every_s
        self._spool = spool
        self._unsent: list[tuple[str, Any]] = []  # given up at close: what the spool keeps
        self._stop = False
        self._thread = threading.Thread(target=self._drain, name="rayspeed-mlflow", daemon=True)
        self._thread.start()

    @property
    def client(self) -> Any:
        """Made on first use, by the queue's thread unless a caller asks first: rank 0's mlflow import and store
        opening (1.5 s of CPU on the 2-core demo, py-spy) then run beside the engine build and the first steps
        instead of before them."""
        with self._client_lock:
            if self._client is None:
                from rayspeed.tracking.client import mlflow_client

                self._client = mlflow_client(self._tracking_uri)
            return self._client

    # ------------------------------------------------------------- producer side (never blocks)
    def _put(self, kind: str, payload: Any) -> None:
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._q.put((kind, payload))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        ts = int(time.time() * 1000)
        self._put("metrics", [(k, float(v), ts, int(step)) for k, v in metrics.items() if v is not None])

    def log_params(self, params: dict[str, Any]) -> None:
        self._put("params", {k: _param_value(v) for k, v in redact_mapping(dict(params)).items()})

    def set_tags(self, tags: dict[str, str]) -> None:
        self._put("tags", {k: str(v) for k, v in redact_mapping({k: str(v) for k, v in tags.items()}).items()})

    def log_text(self, text: str, artifact_file: str) -> None:
        self._put("text", (redact_text(text), artifact_file))

    def log_artifact_file(self, path: str, artifact_path: str | None = None) -> None:
        self._put("file", (path, artifact_path))

    def log_artifact_dir(self, path: str, artifact_path: str | None = None, remove: bool = False) -> None:
        """Upload a folder; with remove, the folder is the logger's: deleted once sent (or given up at close)."""
        if self._stop:  # closed: nothing will send it (a chart render that outlived the job's wait)
            if remove:
                shutil.rmtree(path, ignore_errors=True)
            return
        self._put("dir", (path, artifact_path, remove))

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until everything queued so far reached the server (or the timeout passed), however long it is away;
        while it waits, a failing send is retried at least every WAITED_RETRY_S."""
        return self._wait_idle(timeout_s, give_up_when_away=False)

    def deliver(self, timeout_s: float = 60.0) -> bool:
        """Wait until everything queued so far reached the server, but not for a server that is away: False at once
        when a send failed (the queue keeps the records and sends them when it answers) or the timeout passed.
        What training waits on: tracking never delays it."""
        return self._wait_idle(timeout_s, give_up_when_away=True)

    def _wait_idle(self, timeout_s: float, give_up_when_away: bool) -> bool:
        self._flush_now.set()
        with self._lock:
            self._waiters += 1
        self._wake.set()
        try:
            deadline = time.monotonic() + timeout_s
            while not self._idle.wait(min(AWAY_POLL_S, max(deadline - time.monotonic(), 0))):
                if (give_up_when_away and self._warned) or time.monotonic() >= deadline:
                    return self._idle.is_set()
            return True
        finally:
            with self._lock:
                self._waiters -= 1

    def close(self, timeout_s: float = 60.0) -> None:
        # A run that exists waits (bounded) for its server to come back: the records are its history. A server that
        # never answered had its last chance already (LATE_SERVER_S, rayspeed.train.outputs).
        ok = self.flush(timeout_s) if self.run_id is not None else self.deliver(timeout_s)
        self._stop = True
        self._q.put(("stop", None))
        if ok:
            return
        pending = self._pending
        if self._spool is not None:
            self._thread.join(SPOOL_JOIN_S)  # the send in flight fails (or lands); the rest go to the spool
            if not self._thread.is_alive():
                where, spooled = self._spool(self.run_id, self._unsent)
                log.warning("MLflow: %d queued records were not delivered before shutdown; %d kept in %s for the "
                            "job's next launch to deliver to its run", pending, spooled, where)
                return
        log.warning("MLflow: %d queued records were not delivered before shutdown", pending)

    # ------------------------------------------------------------- consumer side
    def _send(self, kind: str, payload: Any) -> None:
        client = self.client  # first: mlflow is imported there, under the one lock (tracking.client)
        from mlflow.entities import Metric, Param, RunTag

        if self.run_id is None:
            if self._run_factory is None:
                return
            self.run_id = self._run_factory()
            log.warning("MLflow: the tracking server answers; records go to run %s", self.run_id)
            if self._on_run is not None:
                self._on_run(self.run_id)

        if kind == "metrics":
            for i in range(0, len(payload), _MAX_BATCH):
                chunk = payload[i : i + _MAX_BATCH]
                client.log_batch(self.run_id, metrics=[Metric(k, v, ts, s) for k, v, ts, s in chunk])
        elif kind == "params":
            items = list(payload.items())
            existing = client.get_run(self.run_id).data.params
            # A resumed run keeps its first params; a re-plan that changed a value is recorded as a tag.
            fresh = [Param(k, v) for k, v in items if k not in existing]
            changed = {f"replan.{k}": v for k, v in items if k in existing and existing[k] != v}
            for i in range(0, len(fresh), 100):
                client.log_batch(self.run_id, params=fresh[i : i + 100])
            if changed:
                client.log_batch(self.run_id, tags=[RunTag(k, v[:5000]) for k, v in changed.items()])
        elif kind == "tags":
            client.log_batch(self.run_id, tags=[RunTag(k, v[:5000]) for k, v in payload.items()])
        elif kind == "text":
            text, artifact_file = payload
            client.log_text(self.run_id, text, artifact_file)
        elif kind == "file":
            path, artifact_path = payload
            client.log_artifact(self.run_id, path, artifact_path)
        elif kind == "dir":
            path, artifact_path, _ = payload
            client.log_artifacts(self.run_id, path, artifact_path)

    def _drain(self) -> None:
        carry = None
        last_metrics = 0.0
        while True:
            kind, payload = carry if carry is not None else self._q.get()
            carry = None
            if kind == "stop":
                return
            if self._stop and self._unsent:  # closing with the server away: straight to the spool
                self._give_up(kind, payload, 1)
                continue
            taken = 1
            if kind == "metrics":
                wait = last_metrics + self._metrics_every_s - time.monotonic()
                if wait > 0:
                    self._flush_now.wait(wait)
                payload = list(payload)
                while True:  # every metrics record queued meanwhile rides in the same request
                    try:
                        nxt = self._q.get_nowait()
                    except queue.Empty:
                        break
                    if nxt[0] != "metrics":
                        carry = nxt  # keeps order: params/tags/artifacts go after these metrics
                        break
                    payload.extend(nxt[1])
                    taken += 1
                last_metrics = time.monotonic()
            if self._send_retrying(kind, payload):
                self._done(kind, payload, taken)
            else:
                self._give_up(kind, payload, taken)

    def _send_retrying(self, kind: str, payload: Any) -> bool:
        """Sent (True), or given up because the logger is closing with the server away (False)."""
        delay = 0.5
        while True:
            try:
                self._send(kind, payload)
                if self._warned:
                    log.warning("MLflow: tracking server reachable again; queued records delivered")
                    self._warned = False
                return True
            except Exception as e:  # server away, network, store locked: retry, never raise
                if not self._warned:
                    log.warning("MLflow: logging failed (%s); queueing and retrying, training continues", _short(e))
                    self._warned = True
                if self._stop:
                    return False
                self._wake.clear()
                self._wake.wait(min(delay, WAITED_RETRY_S) if self._waiters else delay)
                delay = min(delay * 2, self._retry_max_s)

    def _give_up(self, kind: str, payload: Any, taken: int) -> None:
        self._unsent.append((kind, payload))  # the spool's, at close
        self._done(kind, payload, taken)

    def _done(self, kind: str, payload: Any, taken: int) -> None:
        if kind == "dir" and payload[2]:
            shutil.rmtree(payload[0], ignore_errors=True)
        with self._lock:
            self._pending -= taken
            if self._pending == 0:
                self._flush_now.clear()
                self._idle.set()


def _param_value(v: Any) -> str:
    s = json.dumps(v) if isinstance(v, (dict, list)) else str(v)
    return s[:6000]


def _short(e: Exception) -> str:
    s = str(e).splitlines()[0] if str(e) else type(e).__name__
    return s[:200]
