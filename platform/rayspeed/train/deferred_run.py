"""The job's MLflow run when the tracking server did not answer at launch: rank 0's logger calls DeferredRun()
(retrying with backoff) before it sends anything, and the run id is recorded in the experiment folder, where a
restarted attempt and the launcher (even after a failure) find it."""

from __future__ import annotations

import logging
from typing import Any

from rayspeed import paths, storage
from rayspeed.config.schema import JobConfig

log = logging.getLogger("rayspeed")


def record_deferred_run(experiment_dir: str, run_id: str) -> None:
    try:
        storage.locate(experiment_dir).write_json(paths.DEFERRED_RUN, {"run_id": run_id})
    except Exception as e:  # tracking never fails the job
        log.warning("could not record the deferred MLflow run id: %s", e)


class DeferredRun:
    def __init__(self, cfg: JobConfig, payload: Any, experiment_dir: str):
        self.cfg, self.payload, self.experiment_dir = cfg, payload, experiment_dir
        self.superseded = False

    def __call__(self) -> str:
        from rayspeed.tracking.client import unreachable
        from rayspeed.tracking.runs import find_or_create_run, supersede_run

        uri = self.payload.tracking_uri  # the store the launcher resolved, not this worker's environment's
        down = unreachable(uri)
        if down:  # the logger retries with backoff
            raise ConnectionError(f"no answer from {uri} yet ({down})")
        known = storage.locate(self.experiment_dir).read_json(paths.DEFERRED_RUN).get("run_id")
        if known:  # an earlier attempt of this submission created it (a restart re-reads the launch payload)
            return str(known)
        if self.payload.resume == "fresh" and not self.superseded:
            supersede_run(self.cfg, uri)  # --fresh while the server was down: the old run is set aside now
            self.superseded = True
        return find_or_create_run(self.cfg, uri=uri)[0]
