"""SIGINT (Ctrl-C on `python jobs/train.py` / `make train`) and SIGTERM (`ray job stop`, a scheduler's preemption) on
the launcher: stop the training run, then let the launcher end it as interrupted (exit 130, the MLflow run KILLED,
summary.json `status: interrupted`), so that the same command resumes it from the newest verified checkpoint.

    stop = Interruption(record)         # record(signal name): summary.json, the MLflow run, the line
    with stop:                          # the handlers, in the main thread only (signal's rule)
        trainer.fit()                   # under Ray: the trainer hands its controller's abort to stop.abort_with
    if stop.signal: ...                 # the run was interrupted, whatever fit() raised meanwhile

The handler records the interruption first and stops the run after: `ray job stop` sends SIGKILL 3 s after
SIGTERM (RAY_JOB_STOP_WAIT_TIME_S), and stopping Ray Train's workers takes about 2 s here, so what the user reads
must not wait for it (a driver killed meanwhile takes its workers with it). Under Ray the stop is the controller's
abort; the blocked fit() then returns with an error, which the launcher reads as the interruption. Without a
controller (the local launcher, or before the worker group exists) the handler raises KeyboardInterrupt where the
launcher's thread is. A second signal does not wait for the abort.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Callable, Optional

log = logging.getLogger("rayspeed")

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd command
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interruption:
    def __init__(self, record: Callable[[str], None]) -> None:
        self.record = record
        self.signal: Optional[str] = None
        self._abort: Optional[Callable[[], None]] = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "Interruption":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
        self._abort = None

    def abort_with(self, abort: Callable[[], None]) -> None:
        """What stops the run from now on (Ray Train's controller, once it exists)."""
        self._abort = abort

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt(self.signal)
        self.signal = signal.Signals(signum).name
        try:
            self.record(self.signal)
        except Exception as e:  # the run must stop even when the record cannot be written
            log.warning("could not record the interruption: %s", e)
        if self._abort is None:
            raise KeyboardInterrupt(self.signal)
        self._call_abort()

    def _call_abort(self) -> None:
        abort, self._abort = self._abort, None
        if abort is None:
            return
        try:
            abort()
        except Exception as e:  # the controller exits as it aborts: its actor's death is the expected answer
            log.debug("abort: %s", e)
