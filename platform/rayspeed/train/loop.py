"""The training loop proper: the batches, the step, the checkpointer and the callback list, nothing else (a test
reads this function's body). What to log, validate, account for or export is a callback's business
(rayspeed.train.events); when to save is the checkpointer's (`maybe_save`)."""

from __future__ import annotations

from typing import Any, Iterable

from rayspeed.train.events import Callbacks, TrainState


def run_loop(batches: Iterable[tuple[int, list]], step: Any, checkpointer: Any, callbacks: Callbacks,
             state: TrainState) -> None:
    """Train over `batches` ((index, micro-batches) pairs); `step(state, index, micro)` runs one optimizer step and
    sets state.step and state.loss. A failure (in a step, a save or a callback, the end's included) reaches every
    callback, then propagates."""
    try:
        for index, micro in batches:
            step(state, index, micro)
            callbacks.step_end(state)
            checkpointer.maybe_save(state)
        checkpointer.finish_saves(state)  # the last save commits before the end's outputs
        callbacks.end(state)
    except BaseException as e:
        callbacks.failure(state, e)
        raise
