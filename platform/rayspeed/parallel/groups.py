"""Process groups for data, context, tensor and pipeline parallelism, built once per job.

Rank layout (tp innermost, then cp, then dp, then pp):

    rank = pp_rank * dp * cp * tp + dp_rank * cp * tp + cp_rank * tp + tp_rank

This is the row-major order of DeepSpeed's PipeModelDataParallelTopology (axes
['pipe', 'data', 'model']) with cp folded into its data axis (data index = dp_rank * cp + cp_rank), so a
PipelineModule built from `ParallelGroups.topology()` puts every rank on the same stage / data shard / tensor
slice as these groups do. Keeping tp innermost puts a tensor-parallel group on consecutive ranks, which Ray
packs onto one node: tp traffic (every layer, forward and backward) stays on NVLink; cp next, so its all-to-alls
or ring shifts (every attention) stay inside the node while tp x cp fits in it.

Nothing here is global: the caller builds one ParallelGroups and hands it (or its
`tp` handle) to whatever needs it. The object also serves as DeepSpeed's `mpu`, so
ZeRO shards optimizer state over the data-parallel group only.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Hashable, Optional, Sequence

import torch.distributed as dist

from rayspeed.parallel.context_parallel import NO_CP, ContextParallel
from rayspeed.parallel.expert_parallel import NO_EP, ExpertParallel


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


def rank_of(pp_rank: int, dp_rank: int, tp_rank: int, dp: int, tp: int, cp_rank: int = 0, cp: int = 1) -> int:
    """Global rank of a (pipeline stage, data shard, tensor slice[, sequence part]) coordinate."""
    return ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


def coords_of(rank: int, dp: int, tp: int, cp: int = 1) -> tuple[int, int, int]:
    """(pp_rank, dp_rank, tp_rank) of a global rank; inverse of rank_of (cp_of gives the sequence part)."""
    return rank // (dp * cp * tp), (rank // (cp * tp)) % dp, rank % tp


def cp_of(rank: int, tp: int, cp: int) -> int:
    return (rank // tp) % cp


def layout(dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> dict[str, list[list[int]]]:
    """Every tp / cp / dp / dp x cp / pp / model (tp x pp) group, and with ep the expert groups, as lists of global
    ranks, without any process group. Pure arithmetic so planners and tests can reason about placement before a
    world exists.

    ep is carved out of dp: ep consecutive data-parallel ranks (strided by cp x tp, so inside a node while
    ep x cp x tp fits in it) hold the experts between them ("ep"); the ranks holding the same experts, one in every
    ep group of the dp x cp replicas, are the experts' data-parallel group ("edp": where their gradients reduce).
    """
    def at(p, d, t, c):
        return rank_of(p, d, t, dp, tp, c, cp)

    P, D, T, C = range(pp), range(dp), range(tp), range(cp)
    tp_groups = [[at(p, d, t, c) for t in T] for p in P for d in D for c in C]
    cp_groups = [[at(p, d, t, c) for c in C] for p in P for d in D for t in T]
    dp_groups = [[at(p, d, t, c) for d in D] for p in P for c in C for t in T]
    # ZeRO partitions and gradients reduce over dp x cp: the cp ranks of a replica hold the same weights.
    dpcp_groups = [sorted(at(p, d, t, c) for d in D for c in C) for p in P for t in T]
    pp_groups = [[at(p, d, t, c) for p in P] for d in D for c in C for t in T]
    # DeepSpeed's "model parallel" group is every rank holding a piece of one model replica:
    # all tensor slices of all stages for one data shard (and sequence part).
    mp_groups = [sorted(at(p, d, t, c) for p in P for t in T) for d in D for c in C]
    out = {"tp": tp_groups, "cp": cp_groups, "dp": dp_groups, "dpcp": dpcp_groups, "pp": pp_groups, "mp": mp_groups}
    if ep > 1:
        if dp % ep:
            raise ValueError(f"ep={ep} must divide dp={dp}: expert parallelism is carved out of data parallelism")
        out["ep"] = [[at(p, d0 + j, t, c) for j in range(ep)] for p in P for c in C for t in T
                     for d0 in range(0, dp, ep)]
        out["edp"] = [sorted(at(p, d, t, c) for d in D if d % ep == j for c in C) for p in P for t in T
                      for j in range(ep)]
        # DeepSpeed's model-parallel group under ep: every rank holding a piece of one replica, experts included.
        out["epmp"] = [sorted(at(p, q * ep + j, t, c) for p in P for t in T for j in range(ep))
                       for q in range(dp // ep) for c in C]
    return out


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
    """The dp / cp / tp / pp process groups of an initialized torch.distributed world.

    Construct it on every rank, in the same order relative to other group creation: each
    `dist.new_group` call is collective over the whole world. `timeout` bounds every collective
    on these groups (torch's default for new groups is 30 minutes, whatever the world's is).
    """

    def __init__(self, dp: int, tp: int, pp: int, timeout: Optional[datetime.timedelta] = None, cp: int = 1,
                 cp_scheme: str = "ulysses", ep: int = 1):
        if not dist.is_initialized():
            raise RuntimeError("ParallelGroups needs an initialized torch.distributed world")
        for name, size in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
            if size < 1:
                raise ValueError(f"{name} must be >= 1, got {size}")
        world = dist.get_world_size()
        if dp * cp * tp * pp != world:
            raise ValueError(f"dp*cp*tp*pp = {dp}*{cp}*{tp}*{pp} = {dp * cp * tp * pp} but the world has {world} "
                             "ranks")

        self.dp, self.tp_size, self.pp, self.cp_size = dp, tp, pp, cp
        self.timeout = timeout
        self.world_size = world
        self.global_rank = dist.get_rank()
        self.pp_rank, self.dp_rank, self.tp_rank = coords_of(self.global_rank, dp, tp, cp)
        self.cp_rank = cp_of(self.global_rank, tp, cp)

        groups = layout(dp, tp, pp, cp, ep)
        self.tp_ranks, self.tp_group = self._mine(groups["tp"])
        self.dp_ranks, self.dp_group = self._mine(groups["dp"])
        self.pp_ranks, self.pp_group = self._mine(groups["pp"])
        self.mp_ranks, self.mp_group = self._mine(groups["mp"])
        if cp > 1:
            self.cp_ranks, self.cp_group = self._mine(groups["cp"])
            self.dpcp_ranks, self.dpcp_group = self._mine(groups["dpcp"])
        else:  # no extra groups (each new_group is collective): the sequence is whole and ZeRO spans dp
            self.cp_ranks, self.cp_group = [self.global_rank], None
            self.dpcp_ranks, self.dpcp_group = self.dp_ranks, self.dp_group
        self.ep_size = ep
        if ep > 1:
            self.ep_ranks, ep_group = self._mine(groups["ep"])
            self.edp_ranks, self.edp_group = self._mine(groups["edp"])
            self.epmp_ranks, self.epmp_group = self._mine(groups["epmp"])
            self.ep = ExpertParallel(group=ep_group, rank=self.ep_ranks.index(self.global_rank), world_size=ep)
        else:  # every expert on every rank: they reduce with the rest over dp x cp
            self.ep_ranks, self.edp_ranks, self.edp_group, self.ep = [self.global_rank], self.dpcp_ranks, \
                self.dpcp_group, NO_EP
        self.tp = TensorParallel(group=self.tp_group, rank=self.tp_rank, world_size=tp)
        self.cp = (ContextParallel(group=self.cp_group, rank=self.cp_rank, world_size=cp, ranks=tuple(self.cp_ranks),
                                   scheme=cp_scheme) if cp > 1 else NO_CP)

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

        return PipeModelDataParallelTopology(num_pp=self.pp, num_mp=self.tp_size, num_dp=self.dp * self.cp_size)

    def __repr__(self) -> str:
        cp = f", cp={self.cp_size}" if self.cp_size > 1 else ""
        cp += f", ep={self.ep_size}" if self.ep_size > 1 else ""
        cp_rank = f" cp_rank={self.cp_rank}" if self.cp_size > 1 else ""
        return (
            f"ParallelGroups(dp={self.dp}{cp}, tp={self.tp_size}, pp={self.pp}, rank={self.global_rank}: "
            f"pp_rank={self.pp_rank} dp_rank={self.dp_rank}{cp_rank} tp_rank={self.tp_rank})"
        )

    # --- DeepSpeed mpu interface -------------------------------------------------------------
    # DeepSpeed reads these to find the data-parallel group (batch size), the sequence-data-parallel group
    # (ZeRO partitioning, gradient all-reduce: dp x cp, divided by the sequence-parallel size, so gradients
    # average over dp and add up over cp, as the loss is split) and the model-parallel group (global grad norm,
    # overflow checks). initialize_sequence_parallel is left out on purpose: DeepSpeed 0.19.8 takes its presence
    # for its own Ulysses stack and then ignores the mpu's data and model groups (checked in utils/groups.py).
    # At cp 1 the sequence group has one rank and the sequence-data group is the dp group: no change.

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_ranks)

    def get_sequence_parallel_group(self):
        return self.cp_group

    def get_sequence_parallel_rank(self) -> int:
        return self.cp_rank

    def get_sequence_parallel_world_size(self) -> int:
        return self.cp_size

    def get_sequence_data_parallel_group(self):
        return self.dpcp_group

    def get_sequence_data_parallel_rank(self) -> int:
        return self.dpcp_ranks.index(self.global_rank)

    def get_sequence_data_parallel_world_size(self) -> int:
        return len(self.dpcp_ranks)

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
