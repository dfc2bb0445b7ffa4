"""Direct preference optimisation, as TRL 1.16's DPOTrainer defines it (its `_compute_loss`, reverse-KL scores).

A pair is a prompt with a chosen and a rejected completion. A batch holds the chosen sequences first and the
rejected ones after them, row i of each half from the same pair (TRL's layout), so one forward gives both and a pair
never straddles two micro-batches or two ranks. Each sequence's log-probability is the sum of its completion tokens'
(labels: the completion's tokens, -100 over the prompt and the padding); the reference's the same over the frozen
reference weights. With r = logp - ref_logp for each completion and d = r_chosen - r_rejected:

    sigmoid   -log sigmoid(beta d)                                   (no label smoothing, as in TRL 1.16)
    ipo       (d_len - 1 / (2 beta))^2, d_len: each r over its completion's token count (TRL's length
              normalisation)
    robust    (-(1 - e) log sigmoid(beta d) + e log sigmoid(-beta d)) / (1 - 2e), e = label_smoothing in [0, 0.5)

averaged over the batch's pairs. The rewards are beta r (detached): rewards/chosen, rewards/rejected, their margin
and how often the chosen one's is larger (rewards/accuracies), with logps/chosen and logps/rejected: TRL's names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSSES = ("sigmoid", "ipo", "robust")


@dataclass(frozen=True)
class DpoSettings:
    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"train.dpo.loss: {self.loss!r} is not one of {', '.join(LOSSES)}")
        if self.beta <= 0:
            raise ValueError(f"train.dpo.beta: must be > 0, got {self.beta}")
        if self.loss == "robust" and not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"train.dpo.label_smoothing: robust needs 0 <= it < 0.5, got {self.label_smoothing}")


def sequence_logps(token_logps: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row, the sum of the log-probabilities of its counted labels (token_logps [b, s], 0 where not counted)."""
    return (token_logps * (labels != -100)).sum(dim=1)


def completion_lengths(labels: torch.Tensor) -> torch.Tensor:
    return (labels != -100).sum(dim=1)


def dpo_loss(logps: torch.Tensor, ref_logps: torch.Tensor, lengths: torch.Tensor, s: DpoSettings
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(mean loss over the pairs, per-pair statistics) from the batch's sequence log-probabilities [2n] (chosen
    first), the reference's [2n] and the completions' token counts [2n]."""
    chosen, rejected = logps.chunk(2)
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    r_chosen, r_rejected = chosen - ref_chosen, rejected - ref_rejected
    delta = r_chosen - r_rejected
    if s.loss == "sigmoid":
        per_pair = -F.logsigmoid(s.beta * delta)
    elif s.loss == "ipo":
        len_chosen, len_rejected = lengths.chunk(2)
        d = r_chosen / len_chosen.clamp(min=1) - r_rejected / len_rejected.clamp(min=1)
        per_pair = (d - 1 / (2 * s.beta)) ** 2
    else:
        e = s.label_smoothing
        per_pair = (-(1 - e) * F.logsigmoid(s.beta * delta) + e * F.logsigmoid(-s.beta * delta)) / (1 - 2 * e)
    reward_chosen, reward_rejected = s.beta * r_chosen.detach(), s.beta * r_rejected.detach()
    stats = {"rewards/chosen": reward_chosen, "rewards/rejected": reward_rejected,
             "rewards/accuracies": (reward_chosen > reward_rejected).float(),
             "rewards/margins": reward_chosen - reward_rejected,
             "logps/chosen": chosen.detach(), "logps/rejected": rejected.detach()}
    return per_pair.mean(), stats
