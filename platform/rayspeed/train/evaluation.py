"""Validation: each rank evaluates its share of `train.eval_batches` global batches (the same sequences for every
layout), in micro-batches of the training size. The loss is the mean over the validation labels: averaged over
micro-batches and data-parallel ranks when every label counts, and weighted by each micro-batch's counted labels
when some are ignored (chat, document masking), so it is the mean over every counted label either way."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.distributed as dist

from rayspeed.data.batches import model_inputs, rows_of
from rayspeed.data.token_split import IGNORE_INDEX
from rayspeed.logs import log_rank
from rayspeed.train.events import Callback, TrainState

log = logging.getLogger("rayspeed.worker")


def dp_mean(t: torch.Tensor, groups: Any, device: torch.device) -> float:
    """The mean of `t` over the data-parallel ranks, on the host (a collective of the dp group)."""
    t = t.detach().clone().to(device, dtype=torch.float64)
    if groups.dp > 1:
        dist.all_reduce(t, group=groups.dp_group)
        t /= groups.dp
    return float(t.item())


def local_part(micro_batch: tuple, cp: Any, device: torch.device) -> tuple:
    """This rank's part of each tensor of a micro-batch (ids, labels[, document ids]) under context parallelism: the
    balanced chunks of its sequences (rayspeed.parallel.context_parallel.shard); all of it at cp 1."""
    if cp is None or cp.world_size == 1:
        return tuple(t.to(device, non_blocking=True) for t in micro_batch)
    from rayspeed.parallel.context_parallel import shard

    return tuple(shard(t, cp).to(device, non_blocking=True) for t in micro_batch)


def over_cp(loss: torch.Tensor, cp: Any) -> torch.Tensor:
    """The micro-batch's loss from this rank's share of it (a scalar all-reduce over the cp group), for reporting:
    the gradient path keeps the share, which DeepSpeed adds up over cp."""
    if cp is None or cp.world_size == 1:
        return loss
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=cp.group)
    return loss


def stage_inputs(micro_batch: tuple, device: torch.device) -> Any:
    """What the first pipeline stage takes: the ids, or (ids, segment_ids) with document masking."""
    if len(micro_batch) > 2:
        return (micro_batch[0].to(device), micro_batch[2].to(device))
    return micro_batch[0].to(device)


def stage_batches(micro_batches: list, cp: Any, device: torch.device) -> list:
    """(first stage's inputs, last stage's labels) of each micro-batch for the pipeline engine: this rank's part of
    each sequence under context parallelism (cp: the group, None at cp 1)."""
    parts = [local_part(mb, cp, device) for mb in micro_batches]
    return [(stage_inputs(mb, device), mb[1]) for mb in parts]


class Validator:
    def __init__(self, cfg: Any, batches: list, device: torch.device, pipelined: bool,
                 dp_mean: Callable[[torch.Tensor], float], weighted: bool = False, cp: Any = None):
        """weighted: some labels are ignored (RankBatches.weighted: the same on every rank). cp: the context-parallel
        group (each rank evaluates its part of every sequence)."""
        self.cp = cp
        self.every = cfg.train.eval_every_steps
        self.max_steps = cfg.train.max_steps
        self.micro = cfg.parallel.micro_batch_size
        self.batches, self.device, self.pipelined, self.dp_mean = batches, device, pipelined, dp_mean
        self.weighted = weighted

    def should_validate(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.max_steps

    @torch.no_grad()
    def run(self, engine: Any) -> float:
        engine.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        counted = torch.zeros((), device=self.device, dtype=torch.float64)
        b, n = self.micro, 0
        for mb in self.batches:
            chunks = [rows_of(mb, i, i + b) for i in range(0, mb[0].shape[0], b)]
            if self.pipelined:
                if self.weighted:  # each chunk's summed loss times the chunk count: eval_batch's mean is their sum
                    engine.module.loss_fn.scale = float(len(chunks))
                data = [(stage_inputs(c, self.device), c[1]) for c in (local_part(c, self.cp, self.device)
                                                                        for c in chunks)]
                out = engine.eval_batch(iter(data)).detach().double().mean()
                total += out if self.weighted else out * len(chunks)
                counted += sum(int((c[1] != IGNORE_INDEX).sum()) for c in chunks)
            else:
                for c in chunks:
                    # val/loss is the language loss (a mixture's balance term left out)
                    loss = over_cp(engine(*local_part(c, self.cp, self.device), parts=True,
                                          **model_inputs(c, self.device)).language, self.cp)
                    k = int((c[1] != IGNORE_INDEX).sum())
                    total += loss.detach().double() * (k if self.weighted else 1)
                    counted += k
            n += len(chunks)
        if self.pipelined and self.weighted:
            engine.module.loss_fn.scale = None
        engine.train()
        if self.weighted:
            return self.dp_mean(total) / max(1e-30, self.dp_mean(counted))
        return self.dp_mean(total / max(1, n))


class ValidationCallback(Callback):
    """Validates at train.eval_every_steps and at the last step; fires the `validation` event with the loss."""

    def __init__(self, validator: Validator, engine: Any, events: Any):
        self.validator, self.engine, self.events = validator, engine, events

    def on_step_end(self, state: TrainState) -> None:
        if self.validator.should_validate(state.step):
            state.val_loss = self.validator.run(self.engine)
            log_rank(log, "step %d val loss %.4f", state.step, state.val_loss)
            self.events.validation(state, state.val_loss)
