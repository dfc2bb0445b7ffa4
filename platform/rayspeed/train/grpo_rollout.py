"""One GRPO step's rollouts on a data-parallel rank: its prompts' completions sampled (num_generations each, a group
never split over ranks), scored by the reward functions, the advantages computed over the whole step's rewards
(every rank's, gathered, as TRL gathers them), and the rows the training step reads.

    rollout = sample_step(model, records, ctx)      # StepRollout: rows, completion mask, advantages, metrics
    rollout.micro_batches(micro)                     # (ids, completion mask, advantages) per micro-batch

A row is the prompt and its completion, right-padded to the step's longest: the completion's tokens are its labels
(the mask over label positions, [b, s - 1]), so per-token log-probabilities of rows whose prompts differ in length
line up with a plain causal forward. Metrics carry TRL's names: reward, reward_std, rewards/<function>/mean and
/std, frac_reward_zero_std, completions/mean_length, completions/clipped_ratio, and rollout/tokens_per_s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rayspeed.data.prompts import PromptRecord
from rayspeed.model.generate import Sampling, generate
from rayspeed.objectives.grpo import GrpoSettings, advantages, nanstd, rewards_of
from rayspeed.objectives.rewards import RewardError, RewardLog, TrainerState, reward_name, score


@dataclass
class RolloutContext:
    settings: GrpoSettings
    sampling: Sampling
    rewards: Sequence[Callable[..., Any]]
    weights: torch.Tensor  # [k]
    decode: Callable[[list[int]], Any]  # completion tokens -> what the rewards read (text, or TRL's message list)
    eos_ids: Sequence[int]
    pad_id: int
    group: Any = None  # the data-parallel group (None: this rank alone)
    generator: torch.Generator | None = None
    mask_truncated: bool = False  # TRL's mask_truncated_completions: a completion with no end token trains nothing


@dataclass
class StepRollout:
    ids: torch.Tensor  # [n, s] prompt + completion, right-padded with pad_id
    mask: torch.Tensor  # [n, s - 1] float: 1 where the label (ids[:, 1:]) is a completion token that trains
    advantages: torch.Tensor  # [n]
    metrics: dict[str, float]
    samples: list[dict[str, Any]]  # prompt, completion, reward, advantage (and what the rewards logged)

    def micro_batches(self, micro: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return [(self.ids[i:i + micro], self.mask[i:i + micro], self.advantages[i:i + micro])
                for i in range(0, self.ids.shape[0], micro)]

    @property
    def tokens(self) -> float:
        """This rank's completion tokens that train (what dapo divides by, summed over ranks)."""
        return float(self.mask.sum())


def sample_step(model: torch.nn.Module, records: list[PromptRecord], ctx: RolloutContext,
                state: TrainerState | None = None) -> StepRollout:
    g = ctx.settings.num_generations
    started = time.perf_counter()
    prompt_ids = [r.ids for r in records for _ in range(g)]
    done = generate(model, prompt_ids, ctx.sampling, ctx.eos_ids, ctx.pad_id, generator=ctx.generator)
    seconds = time.perf_counter() - started
    prompts = [r.prompt for r in records for _ in range(g)]
    columns = {k: [r.columns[k] for r in records for _ in range(g)] for k in (records[0].columns if records else {})}
    log = RewardLog()
    texts = [ctx.decode(ids) for ids in done.ids]
    per_function = _scored(ctx, prompts, texts, done.ids, columns, state or TrainerState(), log)
    everyone = _gathered(per_function, ctx.group)
    rewards = rewards_of(everyone, ctx.weights)
    adv, std_zero = advantages(rewards, ctx.settings)
    mine = _my_rows(len(prompts), ctx.group)
    ids, mask = pack(prompt_ids, done.ids, ctx.pad_id)
    if ctx.mask_truncated:
        mask = mask * torch.tensor([0.0 if t else 1.0 for t in done.truncated]).unsqueeze(1)
    metrics = _metrics(everyone, rewards, std_zero, ctx, done, seconds)
    samples = [{"prompt": p, "completion": t, "reward": float(r), "advantage": float(a)}
               for p, t, r, a in zip(prompts, texts, rewards[mine].tolist(), adv[mine].tolist())]
    for column, values in log.extra.items():
        for row, v in zip(samples, values):
            row[column] = v
    metrics.update(log.metric_means())
    return StepRollout(ids, mask, adv[mine], metrics, samples)


def _scored(ctx: RolloutContext, prompts: list[Any], texts: list[Any], ids: list[list[int]],
            columns: dict[str, list[Any]], state: TrainerState, log: RewardLog) -> torch.Tensor:
    """This rank's scores; when a reward function failed on any rank, its RewardError on every rank (none is left
    waiting for the others' rewards)."""
    failure = ""
    try:
        values = score(ctx.rewards, prompts, texts, ids, columns, state, log)
    except RewardError as e:
        failure, values = str(e), torch.full((len(prompts), len(ctx.rewards)), float("nan"))
    if ctx.group is None or dist.get_world_size(ctx.group) == 1:
        if failure:
            raise RewardError(failure)
        return values
    failed = torch.tensor([1.0 if failure else 0.0])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=ctx.group)
    if failed.item():  # only then the messages: pickling collectives stay off the step's path
        messages: list[Any] = [None] * dist.get_world_size(ctx.group)
        dist.all_gather_object(messages, failure, group=ctx.group)
        raise RewardError(next(m for m in messages if m))
    return values


def pack(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows prompt + completion right-padded to the longest, and the completion mask over label positions."""
    rows = [p + c for p, c in zip(prompts, completions)]
    longest = max(2, max(len(r) for r in rows))
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest - 1))
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        mask[i, len(p) - 1:len(p) - 1 + len(c)] = 1.0  # label j is token j + 1
    return ids, mask


def _gathered(local: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's rows in rank order (each rank holds as many)."""
    if group is None or dist.get_world_size(group) == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


def _my_rows(n: int, group: Any) -> slice:
    rank = 0 if group is None else dist.get_rank(group)
    return slice(rank * n, (rank + 1) * n)


def _metrics(per_function: torch.Tensor, rewards: torch.Tensor, std_zero: torch.Tensor, ctx: RolloutContext,
             done: Any, seconds: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for i, fn in enumerate(ctx.rewards):
        out[f"rewards/{reward_name(fn)}/mean"] = float(torch.nanmean(per_function[:, i]))
        out[f"rewards/{reward_name(fn)}/std"] = float(nanstd(per_function[:, i]))
    out["reward"] = float(torch.nanmean(rewards))
    out["reward_std"] = float(nanstd(rewards))
    out["frac_reward_zero_std"] = float(std_zero.float().mean())
    lengths = torch.tensor([float(len(c)) for c in done.ids])
    spread = float(sum(sum(row) for row in done.entropies))
    # One all-reduce: tokens, completions, truncated ones, each rank's tokens per second (their sum the step's) and
    # the summed entropy of the sampled tokens.
    counts = torch.stack([lengths.sum(), torch.tensor(float(len(lengths))), torch.tensor(float(sum(done.truncated))),
                          lengths.sum() / max(seconds, 1e-9), torch.tensor(spread)])
    if ctx.group is not None and dist.get_world_size(ctx.group) > 1:
        dist.all_reduce(counts, group=ctx.group)
    out["completions/mean_length"] = float(counts[0] / counts[1])
    out["completions/clipped_ratio"] = float(counts[2] / counts[1])
    out["rollout/tokens_per_s"] = float(counts[3])
    if done.entropies:
        out["entropy"] = float(counts[4] / counts[0].clamp(min=1.0))
    return out
