"""What the checkpoint protocol needs of a training engine: its state saved into a folder, loaded from one, and
captured as a host snapshot for an asynchronous save. rayspeed.checkpoint talks to this interface only; the
DeepSpeed implementation (and every DeepSpeed file name) is engine/deepspeed_state.py.

    state = as_engine_state(engine)                  # a DeepSpeed engine, or anything implementing EngineState
    state.save(folder, client)                       # this rank's files of the checkpoint
    captured = state.capture(folder, client, copy)   # the same files as (path, host snapshot), none written yet
    write = state.writer()                           # write(snapshot, path), later, on a background thread
    client = state.load(folder)                      # the client state it was saved with
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Protocol, runtime_checkable


@runtime_checkable
class EngineState(Protocol):
    def save(self, folder: Path, client_state: dict[str, Any]) -> None:
        """Write this rank's part of the state (and `client_state`) into folder."""

    def load(self, folder: Path, *, universal: bool = False, module_only: bool = False) -> Optional[dict[str, Any]]:
        """Restore the state saved in folder (`universal`: converted for another layout; `module_only`: weights
        only, the optimizer starts again); the client state it was saved with, None when it holds none."""

    def capture(self, folder: Path, client_state: dict[str, Any], copy: Callable[[Any], Any]) -> list[tuple[str, Any]]:
        """What `save` would write, as (path, copy(state)) with no file written (folders may be made): the host
        snapshot of an asynchronous save."""

    def writer(self) -> Callable[[Any, str], None]:
        """(snapshot, path) -> None: writes one captured file, the bytes `save` writes; safe on another thread."""

    def async_problem(self) -> Optional[str]:
        """Why this state cannot be captured (None: it can)."""

    def versions(self) -> dict[str, str]:
        """Library versions the files depend on, for the manifest."""


def as_engine_state(engine: Any) -> EngineState:
    """`engine` itself when it implements EngineState, else its DeepSpeed state."""
    if isinstance(engine, EngineState):
        return engine
    from rayspeed.engine.deepspeed_state import DeepSpeedState

    return DeepSpeedState(engine)
