"""Reward functions called as TRL 1.16's GRPOTrainer calls them, so that a user's TRL reward functions run unchanged:

    fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_extra=..., log_metric=..., **columns)
        -> list[float | None]

one value per completion (None: the function does not apply; NaN here), `async def` functions too (run together on
one event loop), every other column of the prompt's record passed by name, repeated per completion. A function is
named `package.module:function` in the job file (train.grpo.rewards), imported where the rollouts run. A function
that raises or returns the wrong number of values is a RewardError naming it and the record: one line, not a hung
job.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rayspeed.errors import FinalError

RewardFn = Callable[..., Any]


class RewardError(FinalError):
    """A reward function failed: which one, on which record, and how."""

    status = "reward_failed"


@dataclass
class TrainerState:
    """What TRL's `trainer_state` gives reward functions that shape their reward by progress."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


@dataclass
class RewardLog:
    """What the functions logged at one step: `log_extra(column, values)` columns for the samples table and
    `log_metric(name, value)` scalars for MLflow (averaged over the step's calls)."""

    extra: dict[str, list[Any]] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def log_extra(self, column: str, values: list[Any]) -> None:
        self.extra[column] = list(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[name].append(float(value))

    def metric_means(self) -> dict[str, float]:
        return {k: sum(v) / len(v) for k, v in self.metrics.items() if v}


def load_reward(name: str) -> RewardFn:
    """`package.module:function` (train.grpo.rewards); ImportError/TypeError say why not."""
    module, _, fn_name = name.partition(":")
    if not module or not fn_name:
        raise ImportError(f"{name!r} is not package.module:function")
    fn = getattr(importlib.import_module(module), fn_name, None)
    if fn is None:
        raise ImportError(f"{module} has no {fn_name}")
    if not callable(fn):
        raise TypeError(f"{name} is not a function")
    return fn


def reward_name(fn: RewardFn) -> str:
    """The name TRL's metrics give a function: rewards/<name>/mean."""
    return getattr(fn, "__name__", type(fn).__name__)


def score(functions: Sequence[RewardFn], prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
          columns: dict[str, list[Any]], state: TrainerState, log: RewardLog) -> torch.Tensor:
    """Every function's value for every completion [n, k], NaN where a function returned None."""
    kwargs = dict(columns, trainer_state=state, log_extra=log.log_extra, log_metric=log.log_metric)
    call = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
    out = torch.zeros(len(prompts), len(functions))
    waiting = []
    for i, fn in enumerate(functions):
        if inspect.iscoroutinefunction(fn):
            waiting.append((i, fn))
            continue
        out[:, i] = _values(fn, _guarded(fn, prompts, lambda fn=fn: fn(**call)), len(prompts), prompts)
    if waiting:
        async def gather() -> list[Any]:
            return await asyncio.gather(*(_awaited(fn, prompts, call) for _, fn in waiting))

        for (i, fn), values in zip(waiting, asyncio.run(gather())):
            out[:, i] = _values(fn, values, len(prompts), prompts)
    return out


def _guarded(fn: RewardFn, prompts: list[Any], run: Callable[[], Any]) -> Any:
    try:
        return run()
    except Exception as e:
        raise _raised(fn, prompts, e) from e


async def _awaited(fn: RewardFn, prompts: list[Any], call: dict[str, Any]) -> Any:
    try:
        return await fn(**call)
    except Exception as e:
        raise _raised(fn, prompts, e) from e


def _raised(fn: RewardFn, prompts: list[Any], e: Exception) -> RewardError:
    return RewardError(f"reward function {reward_name(fn)} raised {type(e).__name__}: {e} (on the batch of "
                       f"{len(prompts)} completions starting with prompt {_short(prompts[0])})")


def _values(fn: RewardFn, values: Any, n: int, prompts: list[Any]) -> torch.Tensor:
    try:
        values = list(values)
    except TypeError:
        raise RewardError(f"reward function {reward_name(fn)} returned {type(values).__name__}, not a list of "
                          f"{n} numbers (one per completion)") from None
    if len(values) != n:
        raise RewardError(f"reward function {reward_name(fn)} returned {len(values)} values for {n} completions "
                          f"(one per completion)")
    out = []
    for j, v in enumerate(values):
        if v is None:
            out.append(math.nan)
            continue
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            raise RewardError(f"reward function {reward_name(fn)} returned {v!r} for completion {j} (prompt "
                              f"{_short(prompts[j])}): a number or None") from None
    return torch.tensor(out, dtype=torch.float32)


def _short(prompt: Any) -> str:
    text = prompt if isinstance(prompt, str) else repr(prompt)
    return repr(text[:60] + ("..." if len(text) > 60 else ""))
