"""The loss of a pipeline's last stage: DeepSpeed calls loss_fn(outputs, labels) there, where the outputs are the
head's (hidden states in the tp region, the head's matrix) and, for a mixture of experts, the routing statistics every
stage carried (rayspeed.engine.pipeline_module). The chunked cross-entropy (vocab-parallel at tp > 1) runs on them, so
full logits never exist.

Under context parallelism the engine averages the loss and the gradients over its data axis, dp x cp ranks, where the
parts of a sequence must add up: the loss is multiplied by cp.

Mixtures of experts: the balance loss pools every MoE layer's routing statistics, whichever stage holds it, so each
stage adds its layers' (tokens per expert, router probabilities, rows) to what the earlier stages carried and hands
the sum on beside the hidden states (RouterStats.carried); the last stage's loss adds the balance term from it. The
probabilities keep their graph, so the term's gradient travels back to every stage's routers. The term trains but
is not the reported loss: it enters as b - b.detach() (value 0, gradient b's), so train/loss and val/loss stay the
language-model loss, as without a pipeline.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from rayspeed.model.moe import RouterStats
from rayspeed.parallel.context_parallel import NO_CP, ContextParallel, sum_over_cp
from rayspeed.parallel.groups import TensorParallel
from rayspeed.parallel.layers import NO_TP
from rayspeed.parallel.loss import IGNORE_INDEX, linear_cross_entropy


class PipelineLoss:
    """loss_fn(outputs, labels) for the last stage: fp32 cross-entropy of hidden @ weight^T, the mean over the counted
    labels (-100 is ignored); or, when the trainer sets `scale`, the sum times `scale` (it sets it per step to
    dp * grad_accum / counted labels of the global batch, so the step's loss is the mean over all of them).

    Under cp the labels are this rank's part: the mean divides by the count of every part's labels, and both are
    times cp, because the engine averages over dp x cp ranks what must be summed over cp.

    balance (num_experts, coefficient): a mixture of experts' outputs carry, third, the routing statistics of every
    stage; their balance loss times the coefficient trains beside the returned loss, unscaled, as the training step
    adds it without a pipeline; `aux_sum` / `aux_forwards` add up the unweighted balance losses (moe/aux_loss)."""

    def __init__(self, tp: Optional[TensorParallel] = None, chunk_tokens: Optional[int] = None,
                 cap: Optional[float] = None, cp: Optional[ContextParallel] = None,
                 balance: Optional[tuple[int, float]] = None):
        self.tp = tp or NO_TP
        self.cp = cp or NO_CP
        self.chunk_tokens, self.cap = chunk_tokens, cap
        self.scale: Optional[float] = None
        # A preference objective's loss from each label's cross entropy: labels arrive as (labels, *what it needs).
        self.per_token: Optional[Callable[..., torch.Tensor]] = None
        self.balance = balance
        self.aux_sum: Any = 0.0
        self.aux_forwards = 0

    def __call__(self, outputs, labels: Any) -> torch.Tensor:
        if self.balance is None:
            return self.language(outputs, labels)
        loss = self.language(outputs[:2], labels)
        num_experts, coef = self.balance
        aux = RouterStats.pooled_aux(outputs[2], num_experts)
        if torch.is_grad_enabled():  # a training forward (evaluation's routing is not the balance metric's)
            self.aux_sum = aux.detach() + self.aux_sum
            self.aux_forwards += 1
        term = aux * coef
        return loss + (term - term.detach())

    def language(self, outputs, labels: Any) -> torch.Tensor:
        hidden, weight = outputs
        if self.per_token is not None:
            labels, *extra = labels
            ce = linear_cross_entropy(hidden, weight, labels, self.tp, chunk_tokens=self.chunk_tokens,
                                      reduction="none", cap=self.cap)
            return self.per_token(ce.view(labels.shape), labels, *extra)
        if self.scale is None and not self.cp.enabled:
            return linear_cross_entropy(hidden, weight, labels, self.tp, chunk_tokens=self.chunk_tokens, cap=self.cap)
        total = linear_cross_entropy(hidden, weight, labels, self.tp, chunk_tokens=self.chunk_tokens,
                                     reduction="sum", cap=self.cap)
        if self.scale is not None:
            return total * (self.scale * self.cp.world_size)
        count = sum_over_cp((labels != IGNORE_INDEX).sum(), self.cp).clamp(min=1)
        return total * self.cp.world_size / count
