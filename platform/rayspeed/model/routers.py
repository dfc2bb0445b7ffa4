"""How a mixture of experts picks each token's experts from the router's logits: one rule per routing form, the
MoE's `routing_rule` (model/moe.py). Each returns (weights [tokens, k] fp32, experts [tokens, k], the per-token
probabilities the balance statistics pool [tokens, experts] fp32).

    SoftmaxTopK   softmax over the experts, the top k, renormalised over the k when the shape says so
                  (Qwen3-MoE, Mixtral)
    SigmoidTopK   independent sigmoid scores, the top k, normalised over the k (DeepSeek-V3's scoring, without
                  its group limit and bias correction yet)
"""

from __future__ import annotations

import torch

from rayspeed.config.shape import ModelShape


class SoftmaxTopK:
    def __init__(self, dims: ModelShape):
        self.top_k, self.normalise = dims.experts_per_token, dims.norm_topk_prob

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts, probs


class SigmoidTopK:
    def __init__(self, dims: ModelShape):
        self.top_k = dims.experts_per_token

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(logits.float())
        weights, experts = torch.topk(scores, self.top_k, dim=-1)
        # The balance statistics pool a distribution per token: the scores normalised over the experts.
        return weights / weights.sum(dim=-1, keepdim=True), experts, scores / scores.sum(dim=-1, keepdim=True)
