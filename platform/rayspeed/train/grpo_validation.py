"""What a GRPO job reports beside its loss: val/reward (the weighted reward of greedy completions of the held-out
prompts, every rank's share), and every `train.grpo.samples_every_steps` steps a table of the step's prompts,
completions, rewards and advantages (samples/step_<N>.json, MLflow's table form) from rank 0.

A GRPO job's val/loss is minus val/reward, so that lower is better as for every other loss (the retraining gate
reads val/reward itself)."""

from __future__ import annotations

import json
from typing import Any, Callable

import torch
import torch.distributed as dist

from rayspeed.model.generate import Sampling, generate
from rayspeed.objectives.grpo import rewards_of
from rayspeed.objectives.rewards import RewardLog, TrainerState, score
from rayspeed.train.events import Callback, TrainState


class GrpoValidator:
    def __init__(self, cfg: Any, prompts: list, context: Any, greedy: Sampling, held_out: bool = True):
        """held_out: the job holds prompts out at all (data.val_fraction 0 or no data.val_split: never validates)."""
        self.prompts, self.context, self.greedy, self.held_out = prompts, context, greedy, held_out
        self.every, self.max_steps = cfg.train.eval_every_steps, cfg.train.max_steps
        self.stats: dict[str, float] = {}

    def should_validate(self, step: int) -> bool:
        return self.held_out and (bool(self.every and step % self.every == 0) or step == self.max_steps)

    @torch.no_grad()
    def run(self, engine: Any) -> float:
        ctx = self.context
        sums = torch.zeros(2, dtype=torch.float64)
        if self.prompts:  # a rank may hold none when there are fewer held-out prompts than ranks
            done = generate(engine.module, [p.ids for p in self.prompts], self.greedy, ctx.eos_ids, ctx.pad_id)
            columns = {k: [p.columns[k] for p in self.prompts] for k in self.prompts[0].columns}
            texts = [ctx.decode(ids) for ids in done.ids]
            values = score(ctx.rewards, [p.prompt for p in self.prompts], texts, done.ids, columns, TrainerState(),
                           RewardLog())
            rewards = rewards_of(values, ctx.weights)
            known = ~torch.isnan(rewards)
            sums += torch.tensor([float(rewards[known].sum()), float(known.sum())], dtype=torch.float64)
        if ctx.group is not None and dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(sums, group=ctx.group)
        mean = float(sums[0] / sums[1]) if sums[1] else float("nan")
        self.stats = {"val/reward": mean}
        return -mean


class GrpoReports(Callback):
    """val/reward at each validation; the samples table every N steps (rank 0's tracker)."""

    def __init__(self, validator: GrpoValidator, last: Callable[[], Any], every: int, tracker: Any,
                 logged_until: Callable[[], int]):
        self.validator, self.last, self.every = validator, last, every
        self.tracker, self.logged_until = tracker, logged_until

    def on_validation(self, state: TrainState, val_loss: float) -> None:
        if state.step > self.logged_until() and self.validator.stats:
            self.tracker.log_metrics(self.validator.stats, step=state.step)

    def on_step_end(self, state: TrainState) -> None:
        rollout = self.last()
        if not self.every or state.step % self.every or rollout is None or state.step <= self.logged_until():
            return
        columns = sorted({k for row in rollout.samples for k in row},
                         key=lambda k: (_FIRST.index(k) if k in _FIRST else len(_FIRST), k))
        table = {"columns": columns, "data": [[_plain(row.get(k)) for k in columns] for row in rollout.samples]}
        self.tracker.log_text(json.dumps(table), f"samples/step_{state.step:08d}.json")


_FIRST = ("prompt", "completion", "reward", "advantage")


def _plain(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool)) or value is None else json.dumps(value, default=str)
