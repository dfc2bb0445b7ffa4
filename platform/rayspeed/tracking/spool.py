"""What the tracking server never got: the records rank 0's logger still held when the job ended (the server away
to the end), kept beside the run's checkpoints and delivered to the same run by the job's next launch.

    <experiment>/.tracking_spool/<time>-<run id or "new">.jsonl    a header line {"run_id"}, then {"kind", "payload"}

Metrics, params, tags and text artifacts are kept (already redacted: the logger masks on the way in). File and
folder artifacts are not: they are paths into a temporary folder that is gone with the job (the count is said).
Delivery is all or nothing per file: a file is deleted once every record in it reached the server; a delivery cut
short leaves it for the next launch, which may then repeat a metric point already sent.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Optional

from rayspeed import storage

log = logging.getLogger(__name__)

SPOOL_DIR = ".tracking_spool"
KEPT = ("metrics", "params", "tags", "text")
DELIVER_TIMEOUT_S = 30.0


def write_spool(experiment_dir: str, run_id: Optional[str], records: list[tuple[str, Any]]) -> tuple[str, int]:
    """(where, how many records were kept)."""
    kept = [{"kind": k, "payload": p} for k, p in records if k in KEPT]
    name = f"{SPOOL_DIR}/{time.strftime('%Y%m%dT%H%M%S')}-{int(time.time() * 1000) % 1000:03d}-{run_id or 'new'}.jsonl"
    where = storage.locate(experiment_dir)
    if kept:
        lines = [json.dumps({"run_id": run_id})] + [json.dumps(r) for r in kept]
        where.write_bytes(name, ("\n".join(lines) + "\n").encode())
    return f"{experiment_dir}/{name}", len(kept)


def spooled(experiment_dir: str) -> list[str]:
    where = storage.locate(experiment_dir)
    if not where.exists(SPOOL_DIR):
        return []
    return sorted(f"{SPOOL_DIR}/{n}" for n, _ in where.child(SPOOL_DIR).files() if n.endswith(".jsonl"))


def deliver_spool(experiment_dir: str, tracking_uri: str, run_id: str) -> int:
    """Send every spooled file's records to the run it names (a run created late, or never: `run_id`); returns
    how many records reached the server. Never raises: what is not delivered stays for the next launch."""
    from rayspeed.tracking.logger import MlflowLogger

    where = storage.locate(experiment_dir)
    sent = 0
    for name in spooled(experiment_dir):
        try:
            raw = (where.read_bytes(name) or b"").decode().splitlines()
            header, records = json.loads(raw[0]), [json.loads(line) for line in raw[1:] if line.strip()]
            logger = MlflowLogger(tracking_uri, header.get("run_id") or run_id, retry_max_s=2.0)
            for r in records:
                logger.resend(r["kind"], r["payload"])
            ok = logger.deliver(DELIVER_TIMEOUT_S)
            logger.close(timeout_s=1.0)
        except Exception as e:  # tracking never fails the job
            log.warning("MLflow: could not deliver %s (%s); it stays for the next launch", name, e)
            continue
        if ok:
            where.delete(name)
            sent += len(records)
            log.info("MLflow: delivered %d records an earlier launch could not send (%s)", len(records), name)
        else:
            log.warning("MLflow: %s not delivered (the server does not take it); it stays for the next launch", name)
    return sent
