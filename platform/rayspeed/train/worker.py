"""The worker: the same function under Ray Train (one per worker) and in-process (--launcher local).

At every (re)start each worker joins the process group, agrees with the others on the newest verified
checkpoint, re-plans for the world size it actually got (tp and pp kept from the checkpoint, dp and
accumulation recomputed, the batch policy applied), then hands over to the Trainer.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional

from rayspeed import compat, paths
from rayspeed.checkpoint.manager import choose
from rayspeed.config.load import parse
from rayspeed.config.schema import AUTO, JobConfig
from rayspeed.logs import log_rank
from rayspeed.train.batch_policy import apply_batch_policy
from rayspeed.train.context import WorkerContext
from rayspeed.train.payload import LaunchPayload, RunResult

log = logging.getLogger("rayspeed.worker")


def train_loop(payload: LaunchPayload) -> None:
    """Ray Train's train_loop_per_worker."""
    from rayspeed.logs import quiet_benign

    quiet_benign(bool(payload.job.get("cluster", {}).get("use_gpu")))
    from rayspeed.train.context import ray_context

    run_worker(payload, ray_context())


def pin_model_parallel(job: JobConfig, meta: Optional[dict[str, Any]],
                       keys: tuple[str, ...] = ("tp", "pp", "zero_stage")) -> JobConfig:
    """On resume, tp, pp (a model-parallel reshard is not a restart's job) and the ZeRO stage (its partitions are
    what the checkpoint holds) stay what the checkpoint was written with, where the job leaves them auto; dp and
    accumulation are re-planned for the new world."""
    if not meta:
        return job
    old = meta.get("layout") or {}
    par = job.parallel
    pinned: dict[str, Any] = {k: int(old[k]) for k in keys if getattr(par, k) == AUTO and k in old}
    if "pp" in pinned and old.get("stage_layers") and par.stage_layers is None:  # the pipeline's split too
        pinned["stage_layers"] = [int(n) for n in old["stage_layers"]]
    return dataclasses.replace(job, parallel=dataclasses.replace(par, **pinned)) if pinned else job


def plan_for_world(job: JobConfig, meta: Optional[dict[str, Any]], world: int) -> tuple[JobConfig, Any]:
    """Re-plan for the world this attempt got, with the checkpoint's layout pinned; when its ZeRO stage no longer
    fits, say so and let the planner choose one (the checkpoint is then converted or, from ZeRO-0, its weights
    carried over)."""
    from rayspeed.errors import ConfigError
    from rayspeed.planner import resolve

    try:
        return resolve(pin_model_parallel(job, meta), world_size=world)
    except ConfigError:
        if not meta or job.parallel.zero_stage != AUTO:
            raise
    cfg, plan = resolve(pin_model_parallel(job, meta, keys=("tp", "pp")), world_size=world)
    old = (meta.get("layout") or {}).get("zero_stage")
    log_rank(log, "resume: ZeRO-%s of the checkpoint does not fit %d workers; re-planned to ZeRO-%d",
             old, world, cfg.parallel.zero_stage, level=logging.WARNING)
    return cfg, plan


def run_worker(payload: LaunchPayload, ctx: WorkerContext) -> RunResult:
    t_start = time.time()
    from rayspeed.logs import quiet_benign

    quiet_benign(bool(payload.job.get("cluster", {}).get("use_gpu")))
    import deepspeed

    from rayspeed.logs import setup
    from rayspeed.train.trainer import Trainer

    setup(f"rayspeed rank {ctx.rank}", rank=ctx.rank)
    phases = {"imports": time.time() - t_start}
    job = parse(payload.job)
    if not job.cluster.use_gpu:
        compat.skip_deepspeed_shm_comm_op()
    t = time.time()
    deepspeed.init_distributed(dist_backend="nccl" if job.cluster.use_gpu else "gloo", auto_mpi_discovery=False)
    phases["init_distributed"] = time.time() - t
    if paths.is_uri(payload.experiment_dir):
        # Ray hands workers the path inside its filesystem (bucket/prefix/name); rayspeed keeps the URI form.
        ctx = dataclasses.replace(ctx, experiment_dir=payload.experiment_dir)
    chosen, meta = choose(ctx)
    job, policy_line = apply_batch_policy(pin_model_parallel(job, meta, keys=("tp", "pp")), ctx.world_size)
    # The user's job (with its "auto"s) is re-planned here, for the world this attempt actually got.
    cfg, plan = plan_for_world(job, meta, ctx.world_size)
    log_rank(log, policy_line)
    return Trainer(cfg, plan, ctx, payload, chosen, meta, phases, t_start).run()
