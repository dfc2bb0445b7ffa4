"""A GRPO job's batches: each step's prompts drawn by the seeded global schedule (a step is G / num_generations
prompts, rank r the r-th share of them, a group never split), sampled and scored when the loop asks for the step,
so every step trains on completions of the policy as it is after the previous update.

    batches = GrpoBatches(prompts, schedule, dp_rank, dp, completions_per_step)
    batches.sampler = sampler                 # (index, records) -> the step's micro-batches (rayspeed.train.grpo_setup)
    for index, micro in batches.iterate(start, n): ...
    batches.state_dict()                      # the step and the prompts consumed: a resume under any dp continues

The sampling generator of a step is seeded by (train.seed, step, dp rank), so a resumed job samples what the
uninterrupted one did from the same weights without carrying generator state in the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from rayspeed.data.batches import GlobalBatchSchedule
from rayspeed.data.prompts import PromptRecord


class GrpoBatches:
    weighted = False  # the objective weighs its own tokens (dapo's count over ranks), not the label counts
    document_masking = False
    label_counts = None

    def __init__(self, prompts: list[PromptRecord], schedule: GlobalBatchSchedule, dp_rank: int, dp: int,
                 completions_per_step: int):
        per_step = schedule.global_batch_size
        if per_step % dp:
            raise ValueError(f"{per_step} prompts per step do not split over {dp} data-parallel ranks")
        self.prompts, self.schedule, self.dp_rank, self.dp = prompts, schedule, dp_rank, dp
        self.completions_per_step = completions_per_step
        self.share = per_step // dp
        self.sampler: Callable[[int, list[PromptRecord]], list[tuple]] | None = None
        self.step = schedule.start_step

    def records(self, step: int) -> list[PromptRecord]:
        positions = range(self.dp_rank * self.share, (self.dp_rank + 1) * self.share)
        return [self.prompts[int(i)] for i in self.schedule.indices(step, positions)]

    def generator(self, seed: int, step: int, device: torch.device) -> torch.Generator:
        stream = np.random.SeedSequence([seed, step, self.dp_rank]).generate_state(2, dtype=np.uint32)
        return torch.Generator(device=device).manual_seed(int(stream[0]) << 32 | int(stream[1]))

    def iterate(self, start: int, n: int) -> Iterator[tuple[int, list[tuple]]]:
        if self.sampler is None:
            raise RuntimeError("GrpoBatches.sampler is set by the GRPO objective before the loop starts")
        for index in range(start, start + n):
            micro = self.sampler(index, self.records(index))
            self.step = index + 1
            yield index, micro

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "global_batch_size": self.completions_per_step,
                "consumed_samples": self.schedule.samples_before(self.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
