"""Validation: each rank evaluates its share of `train.eval_batches` global batches (the same sequences for every
layout), in micro-batches of the training size, and the loss is averaged over data-parallel ranks."""

from __future__ import annotations

from typing import Any, Callable

import torch


class Validator:
    def __init__(self, cfg: Any, batches: list, device: torch.device, pipelined: bool,
                 dp_mean: Callable[[torch.Tensor], float]):
        self.every = cfg.train.eval_every_steps
        self.max_steps = cfg.train.max_steps
        self.micro = cfg.parallel.micro_batch_size
        self.batches, self.device, self.pipelined, self.dp_mean = batches, device, pipelined, dp_mean

    def should_validate(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.max_steps

    @torch.no_grad()
    def run(self, engine: Any) -> float:
        engine.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        b, n = self.micro, 0
        for x, y in self.batches:
            chunks = [(x[i : i + b].to(self.device), y[i : i + b].to(self.device)) for i in range(0, x.shape[0], b)]
            if self.pipelined:
                total += engine.eval_batch(iter(chunks)).detach().double().mean() * len(chunks)
            else:
                for cx, cy in chunks:
                    total += engine(cx, cy).detach().double()
            n += len(chunks)
        engine.train()
        return self.dp_mean(total / max(1, n))
