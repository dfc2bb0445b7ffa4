"""Who and where this worker is: under Ray Train or in-process (`--launcher local`, world size 1)."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass


@dataclass
class WorkerContext:
    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    node_id: str
    experiment_dir: str
    under_ray: bool

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def ray_context() -> WorkerContext:
    import ray
    import ray.train

    ctx = ray.train.get_context()
    storage = ctx.get_storage()
    return WorkerContext(
        rank=ctx.get_world_rank(),
        world_size=ctx.get_world_size(),
        local_rank=ctx.get_local_rank(),
        node_rank=ctx.get_node_rank(),
        node_id=ray.get_runtime_context().get_node_id(),
        experiment_dir=storage.experiment_fs_path,
        under_ray=True,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_context(experiment_dir: str, backend: str, timeout_s: float) -> WorkerContext:
    """World size 1 in this process, with a real (gloo or nccl) process group so the same code runs."""
    import torch.distributed as dist

    from rayspeed.storage import locate

    locate(experiment_dir).mkdirs()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
        dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=timeout_s))
    return WorkerContext(0, 1, 0, 0, socket.gethostname(), experiment_dir, under_ray=False)
