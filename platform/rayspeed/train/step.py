"""One optimizer step of the loop: the chaos drill's step hook, the objective's losses of the step's micro-batches
(or the pipeline's train_batch), the watchdog's guard before the update and its action after it, timed for the
metrics window. Nothing else: what a loss is belongs to the objective (rayspeed.train.objective), what the watchdog
does to the guard (rayspeed.train.step_guard), a test reads this class's body.

    step = TrainStep(engine, objective, readings, guard, chaos, timing, device, pipelined)
    step(state, index, micro)              # state.step = index + 1, state.loss = the step's loss
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from rayspeed.train.events import TrainState
from rayspeed.train.objective import Losses, Objective


class TrainStep:
    def __init__(self, engine: Any, objective: Objective, readings: "StepReadings", guard: Any, chaos: Any,
                 timing: Any, device: torch.device, pipelined: bool):
        self.engine, self.objective, self.readings, self.guard = engine, objective, readings, guard
        self.chaos, self.timing, self.device, self.pipelined = chaos, timing, device, pipelined

    def __call__(self, state: TrainState, index: int, micro: list) -> None:
        done = index + 1
        self.chaos.at_step(done)
        with self.timing.timed_step(done):
            loss = self.run(micro, index, done)
        self.guard.act(done)
        state.step, state.loss = done, loss
        self.timing.step_timed(loss)

    def run(self, micro_batches: list, index: int, step: int) -> torch.Tensor:
        engine, objective, poison = self.engine, self.objective, self.chaos.poisons_loss(step)
        scale = objective.scale(index)
        if self.pipelined:
            self.guard.arm(step, None)
            return objective.pipeline_step(engine, micro_batches, scale, poison)
        total = torch.zeros((), device=self.device)
        for mb in micro_batches:
            losses = objective.loss(engine, mb, scale)
            if poison:
                losses = Losses(*(t * float("nan") for t in losses))
            total += losses.reported.detach().float()
            boundary = engine.is_gradient_accumulation_boundary()
            if boundary:  # the step's loss is known before its last backward: the guard's all-reduce overlaps it
                total = objective.whole(total)  # the parts' shares added up once per step, not per micro-batch
                self.guard.arm(step, total / len(micro_batches))
            engine.backward(losses.trained)
            if boundary:
                self.readings.clip()  # gradients are all-reduced by now
            engine.step()
        return total / len(micro_batches)


class StepReadings:
    """The step's learning rate and global gradient norm for the metrics, and the clipping that yields the norm
    where rayspeed clips (rayspeed.engine.clip)."""

    def __init__(self, engine: Any, pipelined: bool, clipper: Any = None, groups: Any = None):
        self.engine, self.pipelined, self.clipper, self.groups = engine, pipelined, clipper, groups
        self.grad_norm: Optional[torch.Tensor] = None

    def clip(self) -> None:
        if self.clipper is not None:
            self.grad_norm = self.clipper()

    def lr(self) -> float:
        return float(self.engine.optimizer.param_groups[0]["lr"]) if self.pipelined else float(self.engine.get_lr()[0])

    def global_grad_norm(self) -> Optional[float]:
        gn = self.grad_norm if self.clipper is not None else self.engine.get_global_grad_norm()
        return None if gn is None else float(gn)

    def own_norm(self) -> Optional[torch.Tensor]:
        """The step's global gradient norm where no DeepSpeed wrapper computes one (ZeRO-0 fp32): the clipper's, or
        computed over this rank's gradients and summed over tensor- and pipeline-parallel ranks."""
        if self.clipper is not None:
            return self.grad_norm
        from rayspeed.engine.clip import global_grad_norm

        return global_grad_norm(self.engine.module.parameters(), self.groups.tp_group, self.groups.pp_group)
