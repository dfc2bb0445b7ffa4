"""Run a function in N local processes joined by a gloo process group (CPU, no GPU needed).

    results = run_distributed(fn, 2, arg1, arg2)   # fn(rank, world_size, arg1, arg2) in each process

`fn` must be importable (defined at module level of a test module or here). What it returns
is saved per rank and handed back as a list. An exception in any rank fails the call with
that rank's traceback; a run that hangs (say, a collective one rank never joins) is killed
after `deadline_s` instead of hanging the test run.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, fn, world_size, tmpdir, timeout_s, env, args):
    os.environ.clear()  # the caller's environment at the call (the fork server's is older), as a spawned child's
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


def run_distributed(fn, world_size: int, *args, timeout_s: float = 60.0, deadline_s: float | None = None,
                    env: dict | None = None):
    """fn(rank, world_size, *args) on world_size spawned processes; returns their results by rank.

    timeout_s bounds each collective on the default group (groups made with new_group keep
    torch's 30-minute default), so deadline_s (default 3 * timeout_s + 60) bounds the whole
    run: past it the processes are killed and the call fails.
    """
    deadline_s = deadline_s or 3 * timeout_s + 60
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "0"}
    child_env.update(env or {})
    # The children fork from one server process that imported torch and DeepSpeed once: a spawned child imports
    # them again (about 8 s per two-rank world on the 2-core VM, 1 s forked). Nothing else is preloaded: what
    # reads the environment at import (transformers' cache paths) is imported by the child, after its environment.
    multiprocessing.set_forkserver_preload(["torch", "deepspeed", "_dist"])
    with tempfile.TemporaryDirectory() as tmpdir:
        context = mp.start_processes(
            _worker,
            args=(fn, world_size, tmpdir, timeout_s, child_env, args),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + deadline_s
        while not context.join(timeout=0.5):  # raises if a rank failed (and stops the others)
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {deadline_s:.0f}s")
        return [torch.load(os.path.join(tmpdir, f"result_{r}.pt"), weights_only=False) for r in range(world_size)]
