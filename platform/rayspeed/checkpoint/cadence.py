"""When to save, and who hears about it: the checkpoint manager bound to one attempt's engine and its listeners.

    saves = Cadence(manager, engine, client_state, events)
    saves.maybe_save(state)       # every step: saves at the cadence, tells the events, reports commits
    saves.finish_saves(state)     # at the end: the save in flight commits first

`events` is anything with before_checkpoint(state), checkpoint_saved(state, stall_s) and
checkpoint_committed(state, record) (rayspeed.train.events.Callbacks): before a save, every step logged so far must
reach the tracker, so a crash just after the commit loses no step a resume would not re-run. `client_state(state)`
is what the checkpoint carries besides the engine's state.
"""

from __future__ import annotations

from typing import Any, Callable


class Cadence:
    def __init__(self, manager: Any, engine: Any, client_state: Callable[[Any], dict[str, Any]], events: Any):
        self.manager, self.engine, self.client_state, self.events = manager, engine, client_state, events

    def maybe_save(self, state: Any) -> None:
        step = state.step
        if self.manager.should_save(step):
            self.events.before_checkpoint(state)
            stall = self.manager.save(step, self.engine, self.client_state(state))
            self.events.checkpoint_saved(state, stall)
        self._committed(state)

    def finish_saves(self, state: Any) -> None:
        self.manager.drain()
        self._committed(state)

    def _committed(self, state: Any) -> None:
        for record in self.manager.poll():  # a sync save at once, an async one when its background write commits
            self.events.checkpoint_committed(state, record)
