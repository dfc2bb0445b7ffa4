"""Process groups for data, tensor and pipeline parallelism, built once per job.

Rank layout (tp innermost, then dp, then pp):

    rank = pp_rank * dp * tp + dp_rank * tp + tp_rank

This is the row-major order of DeepSpeed's PipeModelDataParallelTopology (axes
['pipe', 'data', 'model']), so a PipelineModule built from `ParallelGroups.topology()`
puts every rank on the same stage / data shard / tensor slice as these groups do.
Keeping tp innermost puts a tensor-parallel group on consecutive ranks, which Ray
packs onto one node: tp traffic (every layer, forward and backward) stays on NVLink.

Nothing here is global: the caller builds one ParallelGroups and hands it (or its
`tp` handle) to whatever needs it. The object also serves as DeepSpeed's `mpu`, so
ZeRO shards optimizer state over the data-parallel group only.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Hashable, Optional, Sequence

import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """What a tensor-parallel layer needs to know: its group, its rank in it and the group size.

    world_size 1 (the default) means no tensor parallelism: layers then skip all communication,
    so the same code runs unsharded.
    """

    group: Optional[Any] = None
    rank: int = 0
    world_size: int = 1

    @classmethod
    def from_group(cls, group) -> "TensorParallel":
        return cls(group=group, rank=dist.get_rank(group), world_size=dist.get_world_size(group))

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def rank_of(pp_rank: int, dp_rank: int, tp_rank: int, dp: int, tp: int) -> int:
    """Global rank of a (pipeline stage, data shard, tensor slice) coordinate."""
    return pp_rank * dp * tp + dp_rank * tp + tp_rank


def coords_of(rank: int, dp: int, tp: int) -> tuple[int, int, int]:
    """(pp_rank, dp_rank, tp_rank) of a global rank; inverse of rank_of."""
    return rank // (dp * tp), (rank // tp) % dp, rank % tp


def layout(dp: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """Every tp / dp / pp / model (tp x pp) group as lists of global ranks, without any process group.

    Pure arithmetic so planners and tests can reason about placement before a world exists.
    """
    tp_groups = [[rank_of(p, d, t, dp, tp) for t in range(tp)] for p in range(pp) for d in range(dp)]
    dp_groups = [[rank_of(p, d, t, dp, tp) for d in range(dp)] for p in range(pp) for t in range(tp)]
    pp_groups = [[rank_of(p, d, t, dp, tp) for p in range(pp)] for d in range(dp) for t in range(tp)]
    # DeepSpeed's "model parallel" group is every rank holding a piece of one model replica:
    # all tensor slices of all stages for one data shard.
    mp_groups = [sorted(rank_of(p, d, t, dp, tp) for p in range(pp) for t in range(tp)) for d in range(dp)]
    return {"tp": tp_groups, "dp": dp_groups, "pp": pp_groups, "mp": mp_groups}


def check_tp_within_nodes(node_ids_by_rank: Sequence[Hashable], tp: int) -> None:
    """Raise ValueError if any tensor-parallel group would span two nodes.

    tp communicates inside every layer; across the inter-node network it would dominate the
    step time, so a placement like that is a configuration error, not a slow run.
    `node_ids_by_rank[r]` is the node (any hashable id) that global rank r runs on.
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    world = len(node_ids_by_rank)
    if world % tp != 0:
        raise ValueError(f"tp={tp} does not divide the number of workers ({world})")
    for start in range(0, world, tp):
        ranks = list(range(start, start + tp))
        nodes = sorted({str(node_ids_by_rank[r]) for r in ranks})
        if len(nodes) > 1:
            raise ValueError(
                f"tensor-parallel group of ranks {ranks} spans nodes {nodes}: a tp group must stay "
                f"inside one node. Use a tp that divides the workers per node (tp={tp} now) and "
                f"place each node's workers on consecutive ranks (Ray placement strategy PACK)."
            )


class ParallelGroups:
    """The dp / tp / pp process groups of an initialized torch.distributed world.

    Construct it on every rank, in the same order relative to other group creation: each
    `dist.new_group` call is collective over the whole world. `timeout` bounds every collective
    on these groups (torch's default for new groups is 30 minutes, whatever the world's is).
    """

    def __init__(self, dp: int, tp: int, pp: int, timeout: Optional[datetime.timedelta] = None):
        if not dist.is_initialized():
            raise RuntimeError("ParallelGroups needs an initialized torch.distributed world")
        for name, size in (("dp", dp), ("tp", tp), ("pp", pp)):
            if size < 1:
                raise ValueError(f"{name} must be >= 1, got {size}")
        world = dist.get_world_size()
        if dp * tp * pp != world:
            raise ValueError(f"dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp} but the world has {world} ranks")

        self.dp, self.tp_size, self.pp = dp, tp, pp
        self.timeout = timeout
        self.world_size = world
        self.global_rank = dist.get_rank()
        self.pp_rank, self.dp_rank, self.tp_rank = coords_of(self.global_rank, dp, tp)

        groups = layout(dp, tp, pp)
        self.tp_ranks, self.tp_group = self._mine(groups["tp"])
        self.dp_ranks, self.dp_group = self._mine(groups["dp"])
        self.pp_ranks, self.pp_group = self._mine(groups["pp"])
        self.mp_ranks, self.mp_group = self._mine(groups["mp"])
        self.tp = TensorParallel(group=self.tp_group, rank=self.tp_rank, world_size=tp)

    def _mine(self, rank_lists: list[list[int]]):
        # Every rank creates every group (new_group is collective) and keeps the one it is in.
        mine = None
        for ranks in rank_lists:
            group = dist.new_group(ranks=ranks, timeout=self.timeout)
            if self.global_rank in ranks:
                mine = (ranks, group)
        assert mine is not None
        return mine

    def topology(self):
        """The equivalent DeepSpeed PipeModelDataParallelTopology (same rank layout)."""
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        return PipeModelDataParallelTopology(num_pp=self.pp, num_mp=self.tp_size, num_dp=self.dp)

    def __repr__(self) -> str:
        return (
            f"ParallelGroups(dp={self.dp}, tp={self.tp_size}, pp={self.pp}, rank={self.global_rank}: "
            f"pp_rank={self.pp_rank} dp_rank={self.dp_rank} tp_rank={self.tp_rank})"
        )

    # --- DeepSpeed mpu interface -------------------------------------------------------------
    # DeepSpeed reads these to find the data-parallel group (ZeRO partitioning, gradient
    # all-reduce) and the model-parallel group (global grad norm, overflow checks). We do not
    # define the get_sequence_parallel_* / initialize_sequence_parallel methods on purpose:
    # their presence switches DeepSpeed to Ulysses sequence parallelism, which is a different
    # thing from Megatron-style sequence parallelism inside the tp group used here.

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_ranks)

    def get_model_parallel_group(self):
        return self.mp_group

    def get_model_parallel_rank(self) -> int:
        return self.mp_ranks.index(self.global_rank)

    def get_model_parallel_world_size(self) -> int:
        return len(self.mp_ranks)

    def get_tensor_model_parallel_group(self):
        return self.tp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.tp_ranks[0]

    # DeepSpeed's older name for the tensor-slicing group.
    get_slice_parallel_group = get_tensor_model_parallel_group
    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size

    def get_pipeline_model_parallel_group(self):
        return self.pp_group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp

    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size

    def get_global_rank(self) -> int:
        return self.global_rank
