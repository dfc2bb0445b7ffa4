"""Run a function in N local processes joined by a gloo process group (CPU, no GPU needed).

    results = run_distributed(fn, 2, arg1, arg2)   # fn(rank, world_size, arg1, arg2) in each process

`fn` must be importable (defined at module level of a test module or here). What it returns
is saved per rank and handed back as a list. An exception in any rank fails the call with
that rank's traceback; a collective that one rank never joins fails after `timeout_s`
instead of hanging the test run.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, fn, world_size, tmpdir, timeout_s, env, args):
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)})
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmpdir, "store"), world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(tmpdir, f"result_{rank}.pt"))
    except BaseException:
        # Keep the traceback readable in the pytest report.
        raise RuntimeError(f"rank {rank} failed:\n{traceback.format_exc()}") from None
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout_s: float = 60.0, env: dict | None = None):
    """fn(rank, world_size, *args) on world_size spawned processes; returns their results by rank."""
    child_env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    child_env.update(env or {})
    with tempfile.TemporaryDirectory() as tmpdir:
        mp.start_processes(
            _worker,
            args=(fn, world_size, tmpdir, timeout_s, child_env, args),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        return [torch.load(os.path.join(tmpdir, f"result_{r}.pt"), weights_only=False) for r in range(world_size)]
