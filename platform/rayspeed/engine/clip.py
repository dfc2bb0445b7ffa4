"""Gradient clipping for the layouts where DeepSpeed would clip fp32 gradients itself (ZeRO-0, fp32, no pipeline).

DeepSpeed's fp32 path (`runtime.utils.clip_grad_norm_`) takes one norm per parameter in a Python loop, then
all-reduces the total over the model-parallel group and again over the data-parallel group, where every
rank already holds the same reduced gradients: one extra synchronising collective per step that
DistributedDataParallel does not have. Here the norm is one foreach kernel over replicated gradients plus
one over tensor-parallel shards, with a single all-reduce over the tensor-parallel group only when shards
exist. The result is the same: every shard counted once on its own rank, every replicated parameter once,
and the coefficient min(1, max_norm / (norm + 1e-6)).

The norm stays a tensor: the training loop reads it on the host at log steps only.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist


class GradClipper:
    def __init__(self, parameters: Iterable[torch.nn.Parameter], max_norm: float, tp_group: Any = None):
        params = [p for p in parameters if p.requires_grad]
        tp_sharded = tp_group is not None and dist.get_world_size(tp_group) > 1
        # Experts split over ep (rayspeed.parallel.expert_parallel): each rank's are summed over the ep group.
        self.experts = [p for p in params if getattr(p, "expert_parallel", False)]
        self.sharded = [p for p in params if tp_sharded and getattr(p, "tensor_model_parallel", False)
                        and not getattr(p, "expert_parallel", False)]
        ids = {id(p) for p in self.sharded + self.experts}
        self.replicated = [p for p in params if id(p) not in ids]
        self.params = params
        self.max_norm = float(max_norm)
        self.tp_group = tp_group if tp_sharded else None

    @staticmethod
    def _sq(params: list[torch.nn.Parameter]) -> torch.Tensor | None:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return None
        return torch.nn.utils.get_total_norm(grads, 2.0, foreach=True).float().square()

    def __call__(self) -> torch.Tensor:
        """Clip every gradient in place; return the global L2 norm before clipping (a 0-d tensor)."""
        sq = self._sq(self.replicated)
        held = None
        if self.experts:
            held = self._sq(self.experts)
            held = torch.zeros((), device=self.params[0].device) if held is None else held
            # torch's stubs do not know the tags rayspeed sets on Parameters (MoE.shard_experts)
            dist.all_reduce(held, group=self.experts[0].expert_group)  # type: ignore[attr-defined]
        if self.tp_group is not None:
            shard = self._sq(self.sharded)
            if shard is None:
                shard = torch.zeros((), device=self.params[0].device)
            if held is not None:  # under tp each rank's experts are also tp shards: summed over tp with the others
                shard, held = shard + held, None
            dist.all_reduce(shard, group=self.tp_group)
            sq = shard if sq is None else sq + shard
        if held is not None:
            sq = held if sq is None else sq + held
        if sq is None:
            return torch.zeros(())
        norm = sq.sqrt()
        torch.nn.utils.clip_grads_with_norm_(self.params, self.max_norm, norm, foreach=True)
        return norm


def global_grad_norm(parameters: Iterable[torch.nn.Parameter], tp_group: Any = None, pp_group: Any = None
                     ) -> torch.Tensor:
    """The L2 norm of the model's gradients where DeepSpeed computes none (ZeRO-0 fp32), the same on every rank: this
    rank's replicated gradients, its tensor-parallel shards summed over the tp group, every pipeline stage's part
    summed over the pp group (a weight tied across stages counts once per stage holding it), its experts summed over
    the ep group (each rank holds others)."""
    params = [p for p in parameters if p.grad is not None]
    experts = [p for p in params if getattr(p, "expert_parallel", False)]
    params = [p for p in params if not getattr(p, "expert_parallel", False)]
    sharded_tp = tp_group is not None and dist.get_world_size(tp_group) > 1
    shards = [p for p in params if sharded_tp and getattr(p, "tensor_model_parallel", False)]
    ids = {id(p) for p in shards}
    first_grad = params[0].grad if params else None  # params keeps those with a gradient
    device = first_grad.device if first_grad is not None else torch.device("cpu")
    sq = GradClipper._sq([p for p in params if id(p) not in ids])
    sq = torch.zeros((), device=device) if sq is None else sq
    held = torch.zeros((), device=device)
    if experts:
        expert_sq = GradClipper._sq(experts)
        held = torch.zeros((), device=device) if expert_sq is None else expert_sq
        dist.all_reduce(held, group=experts[0].expert_group)  # type: ignore[attr-defined]  # a rayspeed tag
    if sharded_tp:
        shard = GradClipper._sq(shards)
        shard = (torch.zeros((), device=device) if shard is None else shard) + held  # experts: tp shards too
        held = torch.zeros((), device=device)
        dist.all_reduce(shard, group=tp_group)
        sq = sq + shard
    sq = sq + held
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sq, group=pp_group)
    return sq.sqrt()
