"""The training loop's events and the state they carry. The loop (rayspeed.train.loop) knows the batches, the
step, the checkpointer and one `Callbacks` list; everything else listens: MLflow, throughput and plan feedback,
recovery accounting, validation, the end-of-run outputs, and any callback a job names (`train.callbacks`).

    class Print(Callback):
        def on_step_end(self, state): print(state.step, float(state.loss))

Events, in the order a step sees them: step_end, then log (a log step's metrics) and validation (an eval step's
loss), then before_checkpoint, checkpoint_saved (training resumes) and checkpoint_committed (the manifest is
written; for an async save later, from the background). start comes once after setup; end (after the last step)
and failure (an exception left the loop) go to the callbacks in reverse order, so the first registered (the
tracker) closes last. Every rank calls every event: a callback that communicates (a collective) stays in step, a
callback that writes checks `state.is_rank0`.
"""

from __future__ import annotations

import importlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

log = logging.getLogger("rayspeed.worker")


@dataclass
class TrainState:
    """What the loop and its callbacks share; every field means the same on every rank."""

    max_steps: int
    rank: int = 0
    world_size: int = 1
    step: int = 0
    """Steps done: the last step that finished."""
    start_step: int = 0
    """The step this attempt started from (the checkpoint's, or 0)."""
    restarts: int = 0
    """Restarts before this attempt, from the checkpoint it resumed."""
    resumed_from: Optional[str] = None
    """The checkpoint this attempt resumed (None: a fresh start)."""
    loss: Any = None
    """The last step's loss: a device tensor (float() of it is a host sync)."""
    last_loss: float = math.nan
    """The last logged loss: the log window's mean over steps and data-parallel ranks."""
    val_loss: Optional[float] = None
    """The last validation loss."""
    model_state_bytes: Optional[dict[str, int]] = None
    """Weights, master weights and optimizer state of the real engine, the largest rank's (after step 1)."""
    recovery_s: Optional[float] = None
    """Failure seen by the controller -> this attempt's first step done (None: nothing to recover from)."""
    restarts_seen: int = 0
    """Failures and resizes Ray Train's controller recorded for this job."""
    registered_model_version: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)
    """For callbacks that share something with each other."""

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


class Callback:
    """Override the events you need; each gets the TrainState. Every rank calls every event."""

    def on_start(self, state: TrainState) -> None: ...

    def on_step_end(self, state: TrainState) -> None: ...

    def on_log(self, state: TrainState, metrics: dict[str, float]) -> None: ...

    def on_validation(self, state: TrainState, val_loss: float) -> None: ...

    def on_before_checkpoint(self, state: TrainState) -> None: ...

    def on_checkpoint_saved(self, state: TrainState, stall_s: float) -> None: ...

    def on_checkpoint_committed(self, state: TrainState, record: dict[str, Any]) -> None:
        """record: the save's step, write_s (its write: an async save's background part) and bytes."""

    def on_end(self, state: TrainState) -> None: ...

    def on_failure(self, state: TrainState, error: BaseException) -> None: ...


class Callbacks:
    """The list the loop fires events on, in order (end and failure in reverse)."""

    def __init__(self, items: Iterable[Callback] = ()):
        self.items: list[Callback] = list(items)

    def add(self, cb: Callback) -> None:
        self.items.append(cb)

    def start(self, state: TrainState) -> None:
        for cb in self.items:
            cb.on_start(state)

    def step_end(self, state: TrainState) -> None:
        for cb in self.items:
            cb.on_step_end(state)

    def log(self, state: TrainState, metrics: dict[str, float]) -> None:
        for cb in self.items:
            cb.on_log(state, metrics)

    def validation(self, state: TrainState, val_loss: float) -> None:
        for cb in self.items:
            cb.on_validation(state, val_loss)

    def before_checkpoint(self, state: TrainState) -> None:
        for cb in self.items:
            cb.on_before_checkpoint(state)

    def checkpoint_saved(self, state: TrainState, stall_s: float) -> None:
        for cb in self.items:
            cb.on_checkpoint_saved(state, stall_s)

    def checkpoint_committed(self, state: TrainState, record: dict[str, Any]) -> None:
        for cb in self.items:
            cb.on_checkpoint_committed(state, record)

    def end(self, state: TrainState) -> None:
        for cb in reversed(self.items):
            cb.on_end(state)

    def failure(self, state: TrainState, error: BaseException) -> None:
        for cb in reversed(self.items):
            try:
                cb.on_failure(state, error)
            except Exception as e:  # the original error is what the job must report
                log.warning("%s.on_failure failed too: %s", type(cb).__name__, e)


def load_callback(name: str) -> Callback:
    """`package.module:Class` (train.callbacks) built with no arguments; ImportError/TypeError say why not."""
    module, _, cls_name = name.partition(":")
    cls = getattr(importlib.import_module(module), cls_name, None)
    if cls is None:
        raise ImportError(f"{module} has no {cls_name}")
    if not (isinstance(cls, type) and issubclass(cls, Callback)):
        raise TypeError(f"{name} is not a subclass of rayspeed.train.events.Callback")
    return cls()
