"""What an objective is to the training step and the trainer: one protocol, one class per objective (the language
model's here, rayspeed.train.dpo_objective's DPO), so the step runs any of them without asking which.

    losses = objective.loss(engine, micro_batch, scale)       # Losses(trained, reported)
    engine.backward(losses.trained)
    loss = objective.pipeline_step(engine, micro_batches, scale, poison)   # under a pipeline: the whole step
    listeners = objective.listeners(tracker, logged_until)    # its callbacks and metric sources

The objective owns how a micro-batch becomes a loss (this rank's part of it under context parallelism, the
label-count weighting, what trains beside the reported loss), its validation and its own metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Protocol

import torch

from rayspeed import compat
from rayspeed.data.batches import model_inputs
from rayspeed.data.token_split import IGNORE_INDEX
from rayspeed.train.evaluation import local_part, over_cp, stage_batches


class Losses(NamedTuple):
    trained: torch.Tensor
    """What backward takes."""
    reported: torch.Tensor
    """What train/loss reports (this rank's share of the micro-batch's loss)."""


@dataclass
class Listeners:
    """What an objective or a model feature adds to the run: callbacks (rayspeed.train.events) and metric sources
    (a dict of metrics per log step, rayspeed.train.metrics_callback)."""
    callbacks: list[Any] = field(default_factory=list)
    metrics: list[Callable[[Any], dict[str, float]]] = field(default_factory=list)


class Objective(Protocol):
    validator: Any
    """What validates (should_validate(step), run(engine) -> val/loss)."""

    def scale(self, index: int) -> Optional[float]:
        """Step `index`'s loss weighting (None: each micro-batch's plain mean)."""

    def loss(self, engine: Any, micro_batch: tuple, scale: Optional[float]) -> Losses:
        """One micro-batch's losses."""

    def whole(self, total: torch.Tensor) -> torch.Tensor:
        """The step's summed reported loss from this rank's share (a collective where parts of a sequence are
        spread over ranks)."""

    def pipeline_step(self, engine: Any, micro_batches: list, scale: Optional[float], poison: bool) -> torch.Tensor:
        """The whole step through a pipeline engine's train_batch; its mean loss."""

    def listeners(self, tracker: Any, logged_until: Callable[[], int]) -> Listeners:
        """The objective's own callbacks and metric sources."""


def label_scale(batches: Any, dp: int, grad_accum: int, index: int) -> Optional[float]:
    """With ignored labels (chat, document masking) the loss of a step is the mean over the counted labels of its
    whole global batch, whatever micro-batch or rank they fall in: each micro-batch's summed loss is scaled by
    dp * grad_accum / (counted labels of the global batch), which DeepSpeed's averaging over accumulation and
    data-parallel ranks turns into exactly that mean. None: every label counts (the plain mean)."""
    if not batches.weighted:
        return None
    return dp * grad_accum / max(1, batches.step_tokens(index))


class LanguageModel:
    """Next-token cross entropy: the mean over each micro-batch's counted labels (weighted to the global batch's
    mean when some are ignored); a mixture of experts' balance term trains beside it, unscaled, and is not
    reported."""

    def __init__(self, validator: Any, scales: Callable[[int], Optional[float]], device: torch.device,
                 cp: Any = None, zero_stage: int = 0):
        self.validator, self.scales, self.device, self.cp = validator, scales, device, cp
        self.grad_scale = compat.cp_loss_scale(zero_stage, cp.world_size if cp is not None else 1)

    def scale(self, index: int) -> Optional[float]:
        return self.scales(index)

    def loss(self, engine: Any, micro_batch: tuple, scale: Optional[float]) -> Losses:
        out = engine(*local_part(micro_batch, self.cp, self.device), parts=True,
                     **model_inputs(micro_batch, self.device))
        reported = out.language
        if scale is not None:  # mean over this micro-batch's counted labels -> its share of the step's mean
            reported = reported * (int((micro_batch[1] != IGNORE_INDEX).sum()) * scale)
        trained = reported if out.balance is None else reported + out.balance
        return Losses(trained * self.grad_scale if self.grad_scale != 1.0 else trained, reported)

    def whole(self, total: torch.Tensor) -> torch.Tensor:
        return over_cp(total, self.cp)

    def pipeline_step(self, engine: Any, micro_batches: list, scale: Optional[float], poison: bool) -> torch.Tensor:
        # The loss lives on the last stage: a rank of another stage poisons nothing.
        loss_fn = engine.module.loss_fn
        loss_fn.scale = float("nan") if poison else scale
        try:
            return engine.train_batch(iter(stage_batches(micro_batches, self.cp, self.device))).float().mean()
        finally:
            loss_fn.scale = scale

    def listeners(self, tracker: Any, logged_until: Callable[[], int]) -> Listeners:
        return Listeners()
