"""Every rank's system metrics to rank 0 at a log step (rayspeed.monitoring.system samples them), named by node
and rank: `system/node{n}/rank{r}/...`, plus `memory/*` on GPU.

    metrics = gather_system_metrics(snap, groups)     # collective at log steps; dict on rank 0, None elsewhere
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

from rayspeed.monitoring.system import node_label, node_labels

log = logging.getLogger("rayspeed.monitoring")


def flatten_system_metrics(entries: list[tuple[int, str, dict[str, float]]]) -> dict[str, float]:
    """[(rank, node_id, snapshot)] -> MLflow metric names (the rank-0 side of gather_system_metrics)."""
    entries = sorted(entries, key=lambda e: e[0])
    nodes = node_labels([e[1] for e in entries])
    out: dict[str, float] = {}
    peaks, frags = [], []
    for (rank, _, snap), node in zip(entries, nodes):
        for k, v in (snap or {}).items():
            if k == "gpu_mem_fragmentation_max":
                continue
            try:
                out[f"system/node{node}/rank{rank}/{k}"] = float(v)
            except (TypeError, ValueError):
                continue
        if "gpu_mem_peak_gib" in snap:
            peaks.append(float(snap["gpu_mem_peak_gib"]))
        if "gpu_mem_fragmentation" in snap:
            frags.append(float(snap["gpu_mem_fragmentation"]))
    if peaks:
        out["memory/peak_allocated_gib"] = max(peaks)
    if frags:
        out["memory/fragmentation"] = max(frags)
    out["system/num_nodes"] = float(len(set(nodes))) if nodes else 0.0
    return out


def gather_system_metrics(snapshot: dict[str, float] | None, groups_or_none: Any = None,
                          node_id: Any = None) -> dict[str, float] | None:
    """Collective over the whole world (every rank calls it, at log steps only): rank 0 gets every rank's
    snapshot as flat `system/node{n}/rank{r}/...` metrics (plus `memory/*` on GPU); others get None.

    `snapshot` may be a SystemSampler (its snapshot() is taken) or a dict. Extra per-rank numbers (e.g. a
    CommTimer's `comm_s`) can be merged into the dict and come back under the rank's name too.
    The node label comes from `node_id`, else the SystemSampler built in this process, else the hostname.
    `groups_or_none` is accepted for symmetry with the rest of the worker API; the gather spans the world.
    """
    import torch.distributed as dist

    if hasattr(snapshot, "snapshot"):
        sampler = snapshot
        node_id = node_id if node_id is not None else sampler.node_id
        snapshot = sampler.snapshot()
    try:
        local = {k: float(v) for k, v in (snapshot or {}).items()}
    except Exception:
        local = {}
    if node_id is None:
        node_id = node_label()
    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else 0
    mine = (rank, str(node_id), local)
    if not initialized or dist.get_world_size() == 1:
        return flatten_system_metrics([mine])
    try:
        entries = _gather(mine, dist.get_world_size())
    except Exception as e:
        log.warning("system metrics gather failed (%s); skipped this time", e)
        return None
    if rank != 0:
        return None
    try:
        return flatten_system_metrics(entries)
    except Exception as e:
        log.warning("system metrics flatten failed (%s)", e)
        return None


# (metric names, node id per rank) as every rank last agreed them: later gathers send numbers only.
_SCHEMA: Optional[tuple[list[str], list[str]]] = None


def _gather(mine: tuple[int, str, dict[str, float]], world: int) -> list[tuple[int, str, dict[str, float]]]:
    """Every rank's (rank, node, snapshot). One all-gather of fixed-size rows of numbers (a row's first number
    says whether its rank has a name the rows have no place for), and only then, on every rank at once, the
    snapshots as objects (two collectives and pickling) to agree the names again."""
    import torch
    import torch.distributed as dist

    global _SCHEMA
    keys = _SCHEMA[0] if _SCHEMA is not None else []
    local = mine[2]
    unknown = _SCHEMA is None or len(_SCHEMA[1]) != world or not set(local) <= set(keys)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    row = torch.tensor([float(unknown)] + [local.get(k, math.nan) for k in keys], dtype=torch.float64,
                       device=device)
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row)
    if any(float(r[0]) for r in rows):
        box: list[Any] = [None] * world
        dist.all_gather_object(box, mine)
        entries = [b for b in box if b is not None]
        _SCHEMA = (sorted({k for _, _, snap in entries for k in snap}), [node for _, node, _ in sorted(entries)])
        return entries
    nodes = _SCHEMA[1] if _SCHEMA is not None else []
    return [(r, nodes[r], {k: float(v) for k, v in zip(keys, rows[r][1:].tolist()) if not math.isnan(v)})
            for r in range(world)]
