"""One optimizer step of the loop: the chaos drill's step hook, the forward and backward passes over the step's
micro-batches (or the pipeline's train_batch), the watchdog's guard before the update and its action after it,
timed for the metrics window.

    step = TrainStep(cfg, engine, pipelined, groups, device, batches, chaos, clipper, watchdog, checkpointer, tags)
    step.timing = metrics                  # rayspeed.train.metrics_callback.MetricsCallback
    step(state, index, micro)              # state.step = index + 1, state.loss = the step's loss
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from rayspeed import compat
from rayspeed.checkpoint import manifest
from rayspeed.data.token_split import IGNORE_INDEX
from rayspeed.logs import log_rank
from rayspeed.train.evaluation import local_part, over_cp, stage_batches
from rayspeed.train.events import TrainState

log = logging.getLogger("rayspeed.worker")


class TrainStep:
    def __init__(self, cfg: Any, engine: Any, pipelined: bool, groups: Any, device: torch.device, batches: Any,
                 chaos: Any, clipper: Any, watchdog: Any, checkpointer: Any, tags: Callable[[dict[str, str]], None]):
        self.cfg, self.engine, self.pipelined, self.groups, self.device = cfg, engine, pipelined, groups, device
        self.batches, self.chaos, self.clipper, self.watchdog = batches, chaos, clipper, watchdog
        self.checkpointer, self.tags = checkpointer, tags
        self.timing: Any = None
        self.objective: Any = None  # a DPO job's (rayspeed.train.dpo_objective): the loss of a micro-batch of pairs
        self.grad_norm: Optional[torch.Tensor] = None
        self.guard: Any = None
        if cfg.health.watchdog != "off":
            from rayspeed.train.step_guard import StepGuard

            self.guard = StepGuard(watchdog, engine, groups, self.own_norm)

    def __call__(self, state: TrainState, index: int, micro: list) -> None:
        done = index + 1
        self.chaos.at_step(done)
        with self.timing.timed_step(done):
            loss = self.run(micro, self.loss_scale(index), done)
        self.guarded(done)
        state.step, state.loss = done, loss
        self.timing.step_timed(loss)

    def loss_scale(self, index: int) -> Optional[float]:
        """With ignored labels (chat, document masking) the loss of a step is the mean over the counted labels of
        its whole global batch, whatever micro-batch or rank they fall in: each micro-batch's summed loss is scaled
        by dp * grad_accum / (counted labels of the global batch), which DeepSpeed's averaging over accumulation
        and data-parallel ranks turns into exactly that mean. None: every label counts (the plain mean)."""
        if not self.batches.weighted:
            return None
        return self.groups.dp * self.cfg.parallel.grad_accum / max(1, self.batches.step_tokens(index))

    def run(self, micro_batches: list, scale: Optional[float] = None, step: int = 0) -> torch.Tensor:
        eng = self.engine
        poison = self.chaos.poisons_loss(step)
        if self.pipelined and self.objective is not None:
            if self.guard is not None:
                self.guard.arm(step, None)
            return self.objective.train_batch(eng, micro_batches)
        if self.pipelined:
            if scale is not None:
                eng.module.loss_fn.scale = scale
            if poison:  # the loss lives on the last stage: a rank of another stage poisons nothing
                eng.module.loss_fn.scale = float("nan")
            if self.guard is not None:
                self.guard.arm(step, None)
            loss = eng.train_batch(iter(stage_batches(micro_batches, self.groups, self.device))).float().mean()
            if poison:
                eng.module.loss_fn.scale = scale
            return loss
        total = torch.zeros((), device=self.device)
        cp = getattr(self.groups, "cp", None)
        grad_scale = compat.cp_loss_scale(self.cfg.parallel.zero_stage, cp.world_size if cp is not None else 1)
        for mb in micro_batches:
            loss = (eng(*local_part(mb, cp, self.device)) if self.objective is None
                    else self.objective.train_loss(eng, mb))
            # A mixture of experts' balance term trains but is not the language-model loss train/loss reports,
            # and the label-count scaling below is not for it.
            balance = getattr(eng.module, "balance_loss", None)
            if balance is not None:
                loss = loss - balance
            if scale is not None:  # mean over this micro-batch's counted labels -> its share of the step's mean
                loss = loss * (int((mb[1] != IGNORE_INDEX).sum()) * scale)
            if poison:
                loss = loss * float("nan")
            trained = loss if balance is None else loss + balance
            eng.backward(trained * grad_scale if grad_scale != 1.0 else trained)
            total += loss.detach().float()
            if eng.is_gradient_accumulation_boundary():
                total = over_cp(total, cp)  # the parts' shares added up once per step, not per micro-batch
                if self.clipper is not None:
                    self.grad_norm = self.clipper()  # gradients are all-reduced by now
                if self.guard is not None:
                    self.guard.arm(step, total / len(micro_batches))
            eng.step()
        return total / len(micro_batches)

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

    def guarded(self, step: int) -> None:
        """After the step: act on what the guard decided before its update (it was withheld unless ok)."""
        decision = self.guard.settle() if self.guard is not None else None
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
