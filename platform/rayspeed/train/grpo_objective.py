"""A GRPO job in the step: the loss of one micro-batch of rollout rows (rayspeed.train.grpo_rollout), its clip and
KL statistics over each log window, through rayspeed.train.objective's protocol.

A micro-batch is (ids [b, s], completion mask [b, s - 1], advantages [b], the sampling policy's log-probabilities
or None, the reference's or None, dapo_tokens). Without the sampling policy's (one update per generation batch,
TRL's num_iterations 1) the ratio is the policy's own, detached: 1, with its gradient. DeepSpeed averages the
micro-batches' losses over accumulation steps and data-parallel ranks, which makes each loss type's step loss
TRL's over the whole batch: grpo's mean over completions and dr_grpo's fixed denominator because every
micro-batch holds as many completions, dapo's because each micro-batch divides by the step's completion tokens
over (ranks x accumulation steps), bnpo's per micro-batch as TRL's own (its loss depends on the split).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from rayspeed.objectives.grpo import GrpoSettings, grpo_loss
from rayspeed.train.objective import Listeners, Losses


def completion_logps(model: Callable[..., torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Each label position's log-probability [b, s - 1] under `model` (an engine or a Transformer); the completion
    mask picks the completion's."""
    return -model(ids[:, :-1], ids[:, 1:], reduction="none")


def dapo_tokens(local_tokens: float, group: Any, dp: int, grad_accum: int, device: torch.device) -> float:
    """The step's completion tokens on every data-parallel rank over (dp x grad_accum): what each micro-batch's
    summed terms are divided by (a collective)."""
    t = torch.tensor([local_tokens], dtype=torch.float64, device=device)
    if group is not None and dp > 1:
        dist.all_reduce(t, group=group)
    return float(t) / (dp * grad_accum)


class StatWindow:
    """The statistics' [sum, count] pairs and extremes since the last take."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.low: Optional[torch.Tensor] = None
        self.high: Optional[torch.Tensor] = None

    def add(self, sums: dict[str, torch.Tensor], extremes: dict[str, torch.Tensor]) -> None:
        for k, v in sums.items():
            self.sums[k] = self.sums[k] + v.detach().double() if k in self.sums else v.detach().double()
        low, high = extremes["clip_ratio/low_min"].detach(), extremes["clip_ratio/high_max"].detach()
        self.low = low if self.low is None else torch.minimum(self.low, low)
        self.high = high if self.high is None else torch.maximum(self.high, high)

    def take(self, group: Any) -> dict[str, float]:
        """The means and extremes over every rank of `group` (collectives), then a fresh window."""
        if not self.sums or self.low is None or self.high is None:
            return {}
        names = sorted(self.sums)
        sums = torch.stack([self.sums[k] for k in names])
        low, high = self.low.double().reshape(1), self.high.double().reshape(1)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sums, group=group)
            dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        self.sums, self.low, self.high = {}, None, None
        out = {k: float(s[0] / s[1].clamp(min=1.0)) for k, s in zip(names, sums)}
        out["clip_ratio/low_min"], out["clip_ratio/high_max"] = float(low), float(high)
        return out


class GrpoObjective:
    def __init__(self, settings: GrpoSettings, group: Any, device: torch.device, samples_every: int = 0):
        self.settings, self.group, self.device = settings, group, device
        self.window = StatWindow()
        self.validator: Any = None
        self.rollouts: list[Any] = []  # the steps' rollouts since the last log step (their metrics are averaged)
        self.last: Any = None  # the latest step's rollout (its samples table)
        self.samples_every = samples_every

    def micro_loss(self, engine: Any, micro_batch: tuple) -> torch.Tensor:
        ids, mask, advantage, old, ref, tokens = micro_batch
        ids, mask, advantage = ids.to(self.device), mask.to(self.device), advantage.to(self.device)
        logps = completion_logps(engine, ids)
        old = logps.detach() if old is None else old.to(self.device)
        ref = None if ref is None else ref.to(self.device)
        loss, sums, extremes = grpo_loss(logps, old, ref, advantage, mask, self.settings, dapo_tokens=tokens)
        self.window.add(sums, extremes)
        return loss

    # ------------------------------------------------------------------ the objective protocol
    def scale(self, index: int) -> Optional[float]:
        return None

    def loss(self, engine: Any, micro_batch: tuple, scale: Optional[float]) -> Losses:
        loss = self.micro_loss(engine, micro_batch)
        return Losses(loss, loss)

    def whole(self, total: torch.Tensor) -> torch.Tensor:
        return total

    def pipeline_step(self, engine: Any, micro_batches: list, scale: Optional[float], poison: bool) -> torch.Tensor:
        raise NotImplementedError("GRPO under a pipeline: the job checks refuse parallel.pp > 1")

    def listeners(self, tracker: Any, logged_until: Callable[[], int]) -> Listeners:
        from rayspeed.train.grpo_validation import GrpoReports

        reports = GrpoReports(self.validator, lambda: self.last,
                              self.samples_every, tracker, logged_until)
        return Listeners([reports], [self.metrics])

    def metrics(self, state: Any) -> dict[str, float]:
        """The clip and KL statistics and the rollouts' metrics (every rank's already), averaged over the steps
        since the last log step, as TRL averages its logged values."""
        out = self.window.take(self.group)
        rollouts, self.rollouts = self.rollouts, []
        if rollouts:
            names = sorted({k for r in rollouts for k in r.metrics})
            out.update({k: sum(r.metrics[k] for r in rollouts if k in r.metrics)
                        / sum(1 for r in rollouts if k in r.metrics) for k in names})
        return out
