"""A DPO job in the loop: the step's loss of one micro-batch of pairs, TRL's rewards/logps statistics over each
log window, and validation on held-out pairs.

A micro-batch of b pairs is 2b rows (the chosen ones, then the rejected ones) with, for a precomputed reference,
their 2b reference log-probabilities: a pair never straddles micro-batches or ranks, so each micro-batch's loss is
the mean over its pairs and DeepSpeed's average over accumulation and data-parallel ranks makes the step's loss the
mean over the global batch's pairs, as TRL's. val/loss of a DPO job is the DPO loss on the held-out pairs (what
retraining compares); val/rewards/accuracies and val/rewards/margins are logged beside it.

    dpo = DpoObjective(cfg, groups, device, resident=reference_model)     # resident: None (precomputed), a model
    loss = dpo.train_loss(engine, micro_batch)                             # records the statistics
    dpo.validator = DpoValidator(cfg, dpo, held_out)                       # once its reference is ready
    listeners = dpo.listeners(tracker, logged_until)                       # rewards/*, logps/*, val/rewards/*

The step runs it through rayspeed.train.objective's protocol (scale, loss, whole, pipeline_step, listeners).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from rayspeed.objectives.dpo import DpoSettings, completion_lengths, dpo_loss, sequence_logps
from rayspeed.train.events import Callback, TrainState
from rayspeed.train.objective import Listeners, Losses

log = logging.getLogger("rayspeed.worker")

STATS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
         "logps/rejected")


def logps_of(model: Callable[..., torch.Tensor], ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's completion log-probability under `model` (an engine or a Transformer)."""
    return sequence_logps(-model(ids, labels, reduction="none"), labels)


class StatWindow:
    """Sums of the per-pair statistics and the pair count since the last take (on the device: no sync per step)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sums = torch.zeros(len(STATS) + 2, dtype=torch.float64, device=device)  # + loss sum, pairs

    def add(self, stats: dict[str, torch.Tensor], loss: torch.Tensor) -> None:
        n = stats[STATS[0]].numel()
        row = torch.stack([stats[k].double().sum() for k in STATS] + [loss.detach().double() * n,
                                                                       torch.tensor(float(n), device=self.device,
                                                                                    dtype=torch.float64)])
        self.sums += row

    def take(self, groups: list[Any]) -> Optional[dict[str, float]]:
        """The means over the pairs of every rank of `groups` (collectives), then a fresh window."""
        sums, self.sums = self.sums, torch.zeros_like(self.sums)
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(sums, group=group)
        pairs = float(sums[-1])
        if pairs == 0:
            return None
        out = {k: float(v) / pairs for k, v in zip(STATS, sums[:len(STATS)].tolist())}
        out["loss"] = float(sums[-2]) / pairs
        return out


class DpoObjective:
    def __init__(self, cfg: Any, groups: Any, device: torch.device, resident: Any = None, adapter: bool = False,
                 engine: Any = None, pipelined: bool = False):
        """resident: the frozen reference model (None: the micro-batches carry precomputed log-probabilities, or
        `adapter`: the policy with its adapters turned off is the reference). pipelined: `engine` is DeepSpeed's
        pipeline engine, whose last stage computes the loss (its loss_fn calls pipeline_loss)."""
        s = cfg.train.dpo
        self.settings = DpoSettings(s.loss, s.beta, s.label_smoothing)
        self.groups, self.device, self.resident, self.adapter = groups, device, resident, adapter
        self.grad_accum = cfg.parallel.grad_accum
        self.window = StatWindow(device)
        self.active = self.window  # where pipeline_loss adds: the training window, or a validation's
        self.pipelined = pipelined
        self.captured: list[torch.Tensor] = []
        self.capturing = False
        self.validator: Any = None  # DpoValidator: it scores with this objective, so it comes after
        if pipelined:
            engine.module.loss_fn.per_token = self.pipeline_loss

    @property
    def reduce_groups(self) -> list[Any]:
        """Where statistics are summed: the dp ranks, and under a pipeline the stages (only the last has them)."""
        g = self.groups
        out = [g.dp_group if g.dp > 1 else None]
        if self.pipelined:
            out.append(g.pp_group)
        return out

    @torch.no_grad()
    def reference(self, engine: Any, micro_batch: tuple) -> torch.Tensor:
        if len(micro_batch) > 2:
            return micro_batch[2].to(self.device)
        ids, labels = micro_batch[0].to(self.device), micro_batch[1].to(self.device)
        if self.resident is not None:
            return logps_of(self.resident, ids, labels)
        from rayspeed.adapters.lora import adapters_disabled

        with adapters_disabled(engine.module):
            return logps_of(engine, ids, labels)

    def pair_loss(self, engine: Any, micro_batch: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ref = self.reference(engine, micro_batch)
        ids, labels = micro_batch[0].to(self.device), micro_batch[1].to(self.device)
        return dpo_loss(logps_of(engine, ids, labels), ref.float(), completion_lengths(labels), self.settings)

    def train_loss(self, engine: Any, micro_batch: tuple) -> torch.Tensor:
        loss, stats = self.pair_loss(engine, micro_batch)
        self.window.add(stats, loss)
        return loss

    # ------------------------------------------------------------------ the objective protocol
    def scale(self, index: int) -> Optional[float]:
        return None  # each micro-batch's mean over its pairs; DeepSpeed's averaging makes the global batch's

    def loss(self, engine: Any, micro_batch: tuple, scale: Optional[float]) -> Losses:
        loss = self.train_loss(engine, micro_batch)
        return Losses(loss, loss)

    def whole(self, total: torch.Tensor) -> torch.Tensor:
        return total

    def pipeline_step(self, engine: Any, micro_batches: list, scale: Optional[float], poison: bool) -> torch.Tensor:
        return self.train_batch(engine, micro_batches)

    def listeners(self, tracker: Any, logged_until: Callable[[], int]) -> Listeners:
        return Listeners([DpoValidationMetrics(self.validator, tracker, logged_until)], [self.metrics])

    # ------------------------------------------------------------------ under a pipeline
    def pipeline_loss(self, ce: torch.Tensor, labels: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        logps = sequence_logps(-ce, labels)
        if self.capturing:  # the reference pass: keep the rows, train nothing
            self.captured.append(logps.detach())
            return logps.sum() * 0.0
        loss, stats = dpo_loss(logps, ref.float(), completion_lengths(labels), self.settings)
        self.active.add(stats, loss)
        return loss

    def pipeline_batches(self, micro_batches: list) -> list[tuple[Any, Any]]:
        """What the pipeline reads: the ids for the first stage, (labels, reference) for the last."""
        d = self.device
        return [(mb[0].to(d), (mb[1].to(d), mb[2].to(d) if len(mb) > 2 else torch.zeros(mb[0].shape[0], device=d)))
                for mb in micro_batches]

    def train_batch(self, engine: Any, micro_batches: list) -> torch.Tensor:
        return engine.train_batch(iter(self.pipeline_batches(micro_batches))).float().mean()

    def eval_batches(self, engine: Any, micro_batches: list, window: StatWindow) -> None:
        """Through the pipeline in runs of grad_accum micro-batches (what one eval_batch reads), into `window`."""
        self.active = window
        try:
            for i in range(0, len(micro_batches), self.grad_accum):
                run = micro_batches[i:i + self.grad_accum]
                engine.eval_batch(iter(self.pipeline_batches(run)), num_micro_batches=len(run))
        finally:
            self.active = self.window

    @torch.no_grad()
    def score(self, engine: Any, split: Any, positions: list[int], micro: int) -> torch.Tensor:
        """[len(positions), 2] (chosen, rejected) log-probabilities of a split's pairs under the engine's weights,
        in micro-batches of `micro` pairs (under a pipeline: zeros except on the last stage)."""
        if not self.pipelined:
            ids, labels = (torch.from_numpy(a).to(self.device) for a in split.rows(positions))
            return torch.stack(logps_of(engine, ids, labels).chunk(2), dim=1).double()
        padded = positions + [positions[-1]] * (-len(positions) % micro)  # one shape for every micro-batch
        runs = [padded[i:i + micro] for i in range(0, len(padded), micro)]
        self.captured, self.capturing = [], True
        try:
            self.eval_batches(engine, [tuple(torch.from_numpy(a) for a in split.rows(r)) for r in runs],
                              StatWindow(self.device))
        finally:
            self.capturing = False
        if not self.captured:  # not the last stage
            return torch.zeros(len(positions), 2, dtype=torch.float64, device=self.device)
        rows = torch.cat([torch.stack(c.chunk(2), dim=1) for c in self.captured])[:len(positions)].double()
        self.captured = []
        return rows

    def metrics(self, state: TrainState) -> dict[str, float]:
        """The log window's statistics over every data-parallel rank (TRL's names; a collective)."""
        out = self.window.take(self.reduce_groups)
        if out is None:
            return {}
        out.pop("loss")
        return out


class DpoValidator:
    """The Validator of a DPO job: the DPO loss and statistics over this rank's share of the held-out pairs."""

    def __init__(self, cfg: Any, objective: DpoObjective, batches: list):
        self.objective, self.batches = objective, batches
        self.every, self.max_steps = cfg.train.eval_every_steps, cfg.train.max_steps
        self.stats: dict[str, float] = {}

    def should_validate(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.max_steps

    @torch.no_grad()
    def run(self, engine: Any) -> float:
        o = self.objective
        engine.eval()
        window = StatWindow(o.device)
        if o.pipelined:
            o.eval_batches(engine, self.batches, window)
        else:
            for mb in self.batches:
                loss, stats = o.pair_loss(engine, mb)
                window.add(stats, loss)
        engine.train()
        out = window.take(o.reduce_groups) or {"loss": float("nan")}
        self.stats = {f"val/{k}": out[k] for k in ("rewards/accuracies", "rewards/margins") if k in out}
        return out["loss"]
class DpoValidationMetrics(Callback):
    """val/rewards/accuracies and val/rewards/margins beside val/loss."""

    def __init__(self, validator: DpoValidator, tracker: Any, logged_until: Callable[[], int]):
        self.validator, self.tracker, self.logged_until = validator, tracker, logged_until

    def on_validation(self, state: TrainState, val_loss: float) -> None:
        if state.step > self.logged_until() and self.validator.stats:
            self.tracker.log_metrics(self.validator.stats, step=state.step)
