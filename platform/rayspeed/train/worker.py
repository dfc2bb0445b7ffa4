"""The worker: the same function under Ray Train (one per worker) and in-process (--launcher local).

At every (re)start each worker joins the process group, agrees with the others on the newest verified
checkpoint, plans the attempt once for the world size it actually got (rayspeed.train.attempt_plan: tp and pp
kept from the checkpoint, dp and accumulation recomputed, the batch policy applied), then hands over to the
Trainer.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from rayspeed import compat, paths
from rayspeed.checkpoint.manager import choose
from rayspeed.config.load import parse
from rayspeed.logs import log_rank
from rayspeed.train import oom
from rayspeed.train.attempt_plan import plan_attempt
from rayspeed.train.context import WorkerContext
from rayspeed.train.payload import LaunchPayload, RunResult

log = logging.getLogger("rayspeed.worker")


def train_loop(payload: LaunchPayload) -> dict:
    """Ray Train's train_loop_per_worker: rank 0's RunResult comes back as the run's return value (Ray Train's
    Result.return_value; none when the run fails: the launcher then words the failure from the error)."""
    from rayspeed.logs import quiet_benign

    quiet_benign(bool(payload.job.get("cluster", {}).get("use_gpu")))
    from rayspeed.train.context import ray_context

    return run_worker(payload, ray_context()).to_json()


def run_worker(payload: LaunchPayload, ctx: WorkerContext) -> RunResult:
    t_start = time.time()
    from rayspeed.logs import quiet_benign

    quiet_benign(bool(payload.job.get("cluster", {}).get("use_gpu")))
    deepspeed = compat.import_deepspeed_without_mlflow()

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
    ooms = oom.submission_records(ctx.experiment_dir, payload.launched_at)
    gave_up = oom.give_up_reason(ooms, job.resilience.oom_replans)
    if gave_up:
        log_rank(log, gave_up, level=logging.ERROR)
        return RunResult(status="out_of_memory", error=gave_up, world_size=ctx.world_size)
    # The user's job (with its "auto"s) is planned here, once, for the world this attempt actually got.
    attempt = plan_attempt(job, meta, ctx.world_size, ooms)
    lay = attempt.layout
    log_rank(log, "attempt plan for %d workers: dp %d, tp %d, pp %d, ZeRO-%d, micro-batch %d x %d; %s",
             ctx.world_size, lay.dp, lay.tp, lay.pp, lay.zero_stage, lay.micro_batch_size, lay.grad_accum,
             "; ".join(attempt.notes))
    for note in attempt.notes:
        if "does not fit" in note:  # the checkpoint's layout could not be kept
            log_rank(log, note, level=logging.WARNING)
    return Trainer(attempt.cfg, attempt.plan, ctx, payload, chosen, meta, phases, t_start).run()
