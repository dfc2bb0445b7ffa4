"""Group relative policy optimisation, as TRL 1.16's GRPOTrainer defines it (its `_generate_and_score_completions`
advantages and its `_compute_loss`, token-level importance sampling).

A step samples `num_generations` completions of each prompt. Each completion's reward is the weighted sum of the
reward functions' values (a completion every function scored None is unscorable: NaN, advantage 0); its advantage
is its reward less its group's mean, divided by the group's standard deviation + 1e-4 (`scale_rewards: group`), by
the whole batch's (`batch`) or not divided (`none`). With the policy's per-token log-probabilities p, those of the
policy that sampled them p_old and the reference's p_ref, per completion token:

    ratio = exp(p - p_old), clipped to [1 - epsilon_low, 1 + epsilon_high]
    term  = -min(ratio A, clipped A) + beta ratio (exp(p_ref - p) - (p_ref - p) - 1)

(the KL estimate times the ratio: the unbiased reverse-KL gradient, TRL's `use_bias_correction_kl`, on by default;
the ratio's value is 1 on-policy but its gradient is not zero),

and the loss over the completion tokens (mask):

    grpo      each completion's mean term, averaged over the completions
    bnpo      the micro-batch's mean term
    dr_grpo   the micro-batch's summed terms over (completions x max_completion_length)
    dapo      the summed terms over `dapo_tokens`: the step's completion tokens on every rank, divided by the
              data-parallel ranks and the accumulation steps, so that the step's gradient is the whole batch's
              mean token term however it is split (TRL's default)

Statistics carry TRL's names: clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean (the share of
completion tokens whose ratio was clipped on the side the advantage's sign makes count), clip_ratio/low_min and
clip_ratio/high_max (the least and the most of the completions' own shares) and kl (with beta > 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSSES = ("dapo", "grpo", "dr_grpo", "bnpo")
SCALES = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL's: added to the standard deviation the advantages are divided by


@dataclass(frozen=True)
class GrpoSettings:
    num_generations: int = 8
    loss: str = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    scale_rewards: str = "group"
    max_completion_length: int = 256

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"train.grpo.loss: {self.loss!r} is not one of {', '.join(LOSSES)}")
        if self.scale_rewards not in SCALES:
            raise ValueError(f"train.grpo.scale_rewards: {self.scale_rewards!r} is not one of {', '.join(SCALES)}")
        if self.num_generations < 2:
            raise ValueError(f"train.grpo.num_generations: a group needs at least 2 completions, got "
                             f"{self.num_generations}")
        if self.beta < 0:
            raise ValueError(f"train.grpo.beta: must be >= 0, got {self.beta}")
        if not (0 <= self.epsilon_low < 1 and self.epsilon_high >= 0):
            raise ValueError(f"train.grpo.epsilon_low / epsilon_high: need 0 <= epsilon_low < 1 and epsilon_high "
                             f">= 0, got {self.epsilon_low} / {self.epsilon_high}")
        if self.max_completion_length < 1:
            raise ValueError(f"train.grpo.max_completion_length: must be >= 1, got {self.max_completion_length}")


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The Bessel-corrected standard deviation of the non-NaN values (NaN with fewer than two), in TRL's order of
    operations: its float results are the ones the parity is held to."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count, float("nan"), dtype=x.dtype))
    out = torch.sqrt(variance * correction)
    return out.squeeze() if dim is None else out.squeeze(dim)


def rewards_of(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each completion's reward [n] from the functions' values [n, k] (NaN where a function gave None): the weighted
    sum of the values it has, NaN where it has none."""
    unscorable = torch.isnan(per_function).all(dim=1)
    rewards = (per_function * weights.unsqueeze(0)).nansum(dim=1)
    return rewards.masked_fill(unscorable, float("nan"))


def advantages(rewards: torch.Tensor, s: GrpoSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantage [n], whether its group's rewards all agree [n]) for the step's rewards [n], groups of
    num_generations consecutive completions."""
    groups = rewards.view(-1, s.num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(s.num_generations)
    if s.scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:  # group; with none only told apart for the statistic
        std = nanstd(groups, dim=1).repeat_interleave(s.num_generations)
    out = rewards - mean
    if s.scale_rewards != "none":
        out = out / (std + STD_EPS)
    return torch.nan_to_num(out, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def token_terms(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor | None,
                advantage: torch.Tensor, s: GrpoSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(term [b, t], ratio [b, t], kl [b, t] or None) per completion token; advantage [b]."""
    a = advantage.unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)
    term = -torch.min(ratio * a, clipped * a)
    kl = None
    if s.beta != 0.0:
        assert ref_logps is not None, "beta > 0 needs the reference's log-probabilities"
        kl = (torch.exp(ref_logps - logps) - (ref_logps - logps) - 1) * ratio
        term = term + s.beta * kl
    return term, ratio, kl


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor | None,
              advantage: torch.Tensor, mask: torch.Tensor, s: GrpoSettings, dapo_tokens: float | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(loss of the micro-batch, its statistics' [sum, count] pairs, their extremes) from the completion tokens'
    log-probabilities [b, t] of the policy, the sampling policy and the reference, the completions' advantages [b]
    and the completion mask [b, t]. The statistics are sums and counts so that a step adds them over micro-batches
    and ranks; the extremes are reduced with min (..._min) and max (..._max)."""
    mask = mask.to(logps.dtype)
    term, ratio, kl = token_terms(logps, old_logps, ref_logps, advantage, s)
    masked = term * mask
    if s.loss == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif s.loss == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0)
    elif s.loss == "dr_grpo":
        loss = masked.sum() / (term.size(0) * s.max_completion_length)
    else:
        assert dapo_tokens is not None, "dapo divides by the step's tokens per micro-batch (dapo_tokens)"
        loss = masked.sum() / max(dapo_tokens, 1.0)
    low, high = _clipped(ratio.detach(), advantage, s)
    return loss, _sums(low, high, kl, mask), _extremes(low, high, mask)


def _clipped(ratio: torch.Tensor, advantage: torch.Tensor, s: GrpoSettings) -> tuple[torch.Tensor, torch.Tensor]:
    a = advantage.unsqueeze(1)
    return (ratio < 1 - s.epsilon_low) & (a < 0), (ratio > 1 + s.epsilon_high) & (a > 0)


def _sums(low: torch.Tensor, high: torch.Tensor, kl: torch.Tensor | None, mask: torch.Tensor
          ) -> dict[str, torch.Tensor]:
    tokens = mask.sum().detach()
    shares = {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low | high}
    stats = {k: torch.stack([(v.to(mask.dtype) * mask).sum(), tokens]) for k, v in shares.items()}
    if kl is not None:
        stats["kl"] = torch.stack([(kl.detach() * mask).sum(), tokens])
    return stats


def _extremes(low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    def per_completion(x: torch.Tensor) -> torch.Tensor:
        return (x.to(mask.dtype) * mask).sum(-1) / mask.sum(-1)  # NaN for an empty completion: left out below

    low_share, high_share = per_completion(low), per_completion(high)
    inf = torch.tensor(float("inf"), dtype=mask.dtype)
    return {"clip_ratio/low_min": torch.where(low_share.isnan(), inf, low_share).min(),
            "clip_ratio/high_max": torch.where(high_share.isnan(), -inf, high_share).max()}


def mean_of(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """The statistics' means from their (summed) [sum, count] pairs."""
    return {k: float(v[0] / v[1].clamp(min=1.0)) for k, v in stats.items()}
