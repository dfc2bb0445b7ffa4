"""The watchdog before the update: every optimizer step, the step's loss and global gradient norm are checked
before the optimizer applies anything, so `health.watchdog: skip` withholds a bad update (weights, Adam's moments and
step count stay as they were) and `rollback` restores the last verified checkpoint instead of stepping into it.

    guard = StepGuard(watchdog, engine, groups, own_norm, checkpointer, tags)   # installs itself in the optimizer
    guard.arm(step, loss)                                     # before the boundary's engine.step() / train_batch
    engine.step()                                             # the optimizer asks guard() once or per group
    decision = guard.settle()                                 # what was decided this step (None: no update due)
    guard.act(step)                                           # after it: settle, then skip or roll back

NO_GUARD stands in with health.watchdog off (arm and act do nothing).

Where the numbers come from: the loss is this rank's micro-batch mean, averaged over the data-parallel group. The
guard is armed before the boundary's backward, so under ZeRO-0 the loss rides in DeepSpeed's own gradient all-reduce
(rayspeed.compat.loss_rider) and costs no collective of its own; where the engine reduces elsewhere (ZeRO-1-3, bf16)
it is all-reduced alone when the optimizer asks (one scalar all-reduce per step: the price of deciding before the
update). With a pipeline the loss lives on the last stage and is left out, the gradient norm carries a non-finite
loss anyway. The norm is the one DeepSpeed's ZeRO
or bf16 optimizer computed for this step before it calls the client optimizer (rayspeed.compat.step_grad_norm), or
the worker's own (its clipper's, or computed over tensor- and pipeline-parallel ranks) where no wrapper computes one.
Every rank sees the same two numbers, so every rank decides the same. Where DeepSpeed itself drops the step (its
overflow check on a non-finite norm: fp32 ZeRO, fp16) the client optimizer is never asked; settle() still tells the
watchdog, so a run of bad steps counts towards watchdog_max_skips either way.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from rayspeed import compat
from rayspeed.checkpoint import manifest
from rayspeed.logs import log_rank

log = logging.getLogger("rayspeed.worker")


class NoGuard:
    def arm(self, step: int, loss: Optional[torch.Tensor]) -> None:
        pass

    def act(self, step: int) -> None:
        pass


NO_GUARD = NoGuard()


class StepGuard:
    def __init__(self, watchdog: Any, engine: Any, groups: Any, own_norm: Callable[[], Optional[torch.Tensor]],
                 checkpointer: Any = None, tags: Callable[[dict[str, str]], None] = lambda tags: None):
        self.watchdog, self.engine, self.groups, self.own_norm = watchdog, engine, groups, own_norm
        self.checkpointer, self.tags = checkpointer, tags
        self.step = 0
        self.loss: Optional[float] = None
        self.decision: Any = None
        self._loss_tensor: Optional[torch.Tensor] = None
        self._reduced = False
        self.rider = compat.loss_rider(engine, (groups.dp, groups.dp * getattr(groups, "cp_size", 1))) \
            if groups.dp > 1 else None
        self._skipped: Optional[int] = None
        opt = engine.optimizer  # the client optimizer itself (ZeRO-0 fp32) or DeepSpeed's wrapper around it
        client = opt if isinstance(opt, torch.optim.Optimizer) else getattr(opt, "optimizer", None)
        if client is None or not hasattr(client, "guard"):
            raise TypeError(f"the client optimizer {type(client).__name__} takes no guard (rayspeed builds "
                            "GuardedAdamW)")
        client.guard = self

    def arm(self, step: int, loss: Optional[torch.Tensor]) -> None:
        """Before the step's last backward (or its update, where it has none): its number and this rank's loss (None
        under a pipeline)."""
        self.step, self.decision, self._loss_tensor, self._reduced = step, None, None, False
        self._skipped = int(getattr(self.engine, "skipped_steps", 0))
        if loss is not None:
            self._loss_tensor = loss.detach().float().reshape(()).clone()
            if self.rider is not None:
                self.rider.load(self._loss_tensor)

    def _loss(self) -> Optional[float]:
        """The step's loss, the data-parallel mean: as the gradient all-reduce carried it, else reduced here."""
        if self._loss_tensor is not None and not self._reduced and self.groups.dp > 1:
            carried = self.rider.mean() if self.rider is not None else None
            if carried is None:
                dist.all_reduce(self._loss_tensor, group=self.groups.dp_group)
                carried = self._loss_tensor / self.groups.dp
            self._loss_tensor = carried
        self._reduced = True
        return None if self._loss_tensor is None else float(self._loss_tensor)

    def __call__(self) -> bool:
        if self.decision is None:
            norm = compat.step_grad_norm(self.engine)
            if norm is None:
                norm = self.own_norm()
            self.decision = self.watchdog.check(self.step, self._loss(), None if norm is None else float(norm))
        return self.decision.ok

    def settle(self) -> Any:
        """After the step: the decision (None when no step was armed)."""
        if self.decision is None and self._armed():
            assert self._skipped is not None  # what _armed() checks
            if int(getattr(self.engine, "skipped_steps", 0)) > self._skipped:  # DeepSpeed dropped it (overflow)
                self.decision = self.watchdog.check(self.step, self._loss(), float("inf"))
        return self.decision

    def _armed(self) -> bool:
        return self._skipped is not None

    def act(self, step: int) -> None:
        """After the step: act on what was decided before its update (it was withheld unless ok)."""
        decision = self.settle()
        if decision is None or decision.ok:
            return
        if decision.action == "skip":
            self.tags({f"rayspeed.watchdog.step{step}": f"skipped: {decision.reason}"[:4000]})
            return
        chosen = self.checkpointer.rollback(self.engine)
        if chosen is None:
            log_rank(log, "watchdog: %s, but no verified checkpoint to roll back to; the update was not applied, "
                     "continuing", decision.reason, level=logging.WARNING)
            return
        # Continue with the data after the bad window: replaying it would reproduce the same blow-up.
        self.watchdog.reset()
        name = manifest.name_of(chosen)
        log_rank(log, "watchdog: %s -> rolled back to %s, skipping the data of steps %d..%d", decision.reason, name,
                 (manifest.step_of(chosen) or 0) + 1, step, level=logging.WARNING)
        self.tags({f"rayspeed.watchdog.step{step}": f"rollback to {name}: {decision.reason}"[:4000]})
