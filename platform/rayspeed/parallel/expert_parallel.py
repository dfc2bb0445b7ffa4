"""Expert parallelism: the experts of every MoE layer split over the ep ranks (rank j of the group holds experts
j * E/ep .. (j + 1) * E/ep - 1, in order), and each token's hidden state travels to the rank of each expert it is
routed to and back, by two all-to-alls per layer (forward; two more in backward).

    ep = ExpertParallel.from_group(group)
    route = Dispatch(tokens_per_expert, ep)   # [E] this rank's rows per global expert (its rows sorted by expert)
    local = route.send(rows)                  # the rows every rank sends to this rank's experts, grouped by expert
    out = experts(local, route.local_offsets) # grouped matrix products over the local experts
    back = route.back(out)                    # this rank's rows again, in the order they were sent

The exchange is dropless (every routed row travels; uneven splits, which gloo and NCCL both take): the receiving
rank's row count varies from step to step with the routing, which is what the load-imbalance metrics watch.
Nothing here knows the model: a MoE layer (rayspeed.model.moe) calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ExpertParallel:
    """The ep group of a rank (its rank in it, its size); world_size 1: every expert on every rank."""

    group: Optional[Any] = None
    rank: int = 0
    world_size: int = 1

    @classmethod
    def from_group(cls, group) -> "ExpertParallel":
        return cls(group=group, rank=dist.get_rank(group), world_size=dist.get_world_size(group))

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def local_experts(self, num_experts: int) -> range:
        """The global ids of this rank's experts."""
        if num_experts % self.world_size:
            raise ValueError(f"{num_experts} experts do not split over ep={self.world_size} ranks")
        n = num_experts // self.world_size
        return range(self.rank * n, (self.rank + 1) * n)


NO_EP = ExpertParallel()


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], ep: ExpertParallel) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=ep.group)
    return out


class Exchange(torch.autograd.Function):
    """Rows [n, ...] split `send` over the ep ranks, `recv` from each back; the gradient makes the opposite trip."""

    @staticmethod
    def forward(ctx, x, send, recv, ep):
        ctx.splits, ctx.ep = (send, recv), ep
        return _exchange(x, send, recv, ep)

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.splits
        return _exchange(grad, recv, send, ctx.ep), None, None, None


class Dispatch:
    """One layer's routing over the ep group: who sends how many rows to whom, and the regrouping of the received
    rows (by source rank, then expert) into rows by local expert (sources in rank order within each)."""

    def __init__(self, tokens_per_expert: torch.Tensor, ep: ExpertParallel):
        self.ep = ep
        n = ep.world_size
        local = tokens_per_expert.numel() // n
        counts = tokens_per_expert.to(torch.int64).contiguous()
        received = torch.empty_like(counts)  # [source rank, local expert]: what each rank sends to my experts
        dist.all_to_all_single(received, counts, group=ep.group)
        received = received.view(n, local)
        self.send_splits = counts.view(n, local).sum(1).tolist()
        self.recv_splits = received.sum(1).tolist()
        expert_of_row = torch.repeat_interleave(torch.arange(local).repeat(n), received.reshape(-1).cpu())
        self.order = torch.argsort(expert_of_row, stable=True).to(tokens_per_expert.device)
        self.tokens_per_local_expert = received.sum(0)

    @property
    def local_offsets(self) -> torch.Tensor:
        """Cumulative row counts of the local experts (grouped_mm's offs)."""
        return torch.cumsum(self.tokens_per_local_expert, 0).to(torch.int32)

    def send(self, rows: torch.Tensor) -> torch.Tensor:
        got = Exchange.apply(rows, self.send_splits, self.recv_splits, self.ep)
        return got[self.order]

    def back(self, out: torch.Tensor) -> torch.Tensor:
        restored = torch.zeros_like(out).index_copy(0, self.order, out)
        return Exchange.apply(restored, self.recv_splits, self.send_splits, self.ep)


def gather_experts(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The whole expert stack from each ep rank's rows (collective over the ep group; rank order is expert order)."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=0)


class ScaleGrad(torch.autograd.Function):
    """The identity forward; the gradient times `factor` (what reaches the weights behind it)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def average_over_ep(params, ep: ExpertParallel) -> list:
    """Hooks that average each parameter's gradient over the ep group as soon as it is accumulated (before
    DeepSpeed's own hooks, registered later, reduce it over the experts' data-parallel group): the weights every
    ep rank holds alike (all but the experts) then take the gradient of every data-parallel rank's tokens. An
    accumulated gradient is averaged again at the next micro-batch, which leaves its earlier, equal, part as it is."""

    def hook(p):
        if p.grad is not None:
            dist.all_reduce(p.grad, group=ep.group)
            p.grad.div_(ep.world_size)

    return [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]


class DeepSpeedView:
    """DeepSpeed's mpu when experts are sharded: its data-parallel group is the experts' (dp / ep ranks holding the
    same experts), where ZeRO partitions and reduces; its model-parallel group holds a whole replica, experts
    included (checkpoint files per piece, gradient norms summed over the pieces, experts marked model_parallel).
    The weights every ep rank holds alike are averaged over ep first (average_over_ep), the experts' gradients
    scaled by 1 / ep (ScaleGrad in the layer): both then equal the mean over every data-parallel rank."""

    def __init__(self, groups: Any):
        self.groups = groups

    def get_data_parallel_group(self):
        return self.groups.edp_group

    def get_data_parallel_rank(self) -> int:
        return self.groups.edp_ranks.index(self.groups.global_rank)

    def get_data_parallel_world_size(self) -> int:
        return len(self.groups.edp_ranks)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.groups.edp_ranks)

    get_sequence_data_parallel_group = get_data_parallel_group
    get_sequence_data_parallel_rank = get_data_parallel_rank
    get_sequence_data_parallel_world_size = get_data_parallel_world_size

    def get_sequence_parallel_group(self):
        return None

    def get_sequence_parallel_rank(self) -> int:
        return 0

    def get_sequence_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_group(self):
        return self.groups.epmp_group

    def get_model_parallel_rank(self) -> int:
        return self.groups.epmp_ranks.index(self.groups.global_rank)

    def get_model_parallel_world_size(self) -> int:
        return len(self.groups.epmp_ranks)

    def get_tensor_model_parallel_rank(self) -> int:
        """DeepSpeed counts a weight that is not marked model-parallel in a gradient norm on tensor rank 0 only: the
        weights every ep rank holds alike are such copies, so the rank it reads spans tp x ep."""
        return self.groups.ep.rank * self.groups.tp_size + self.groups.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        """The pieces of a replica, as the rank above counts them: the model-state files a checkpoint holds (its
        recorded tensor degree) and the cuts a universal checkpoint's expert stacks take at load."""
        return self.groups.ep.world_size * self.groups.tp_size

    get_slice_parallel_world_size = get_tensor_model_parallel_world_size  # what a universal load asks first

    def __getattr__(self, name: str) -> Any:  # tensor and pipeline groups: the job's own
        if name.startswith("get_"):
            return getattr(self.groups, name)
        raise AttributeError(name)
