"""Python objects across ranks (choices, errors, small reports): the default group, a no-op at world size 1."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    """Every rank of the default group meets here (a no-op at world size 1)."""
    if _world() > 1:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s obj on every rank."""
    if _world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's obj, in rank order, on every rank (also a barrier)."""
    if _world() == 1:
        return [obj]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def raise_first_error(errors: list[Any], what: str = "") -> None:
    """Raise RuntimeError with the first non-empty error a rank reported (every rank raises the same)."""
    first = next((e for e in errors if e), None)
    if first is not None:
        raise RuntimeError(f"{what}{first}" if what else str(first))
