"""The global batch after a resize (resilience.batch_policy). Pure: no torch, no Ray.

keep_global keeps the global batch (accumulation absorbs the change). playbook (PLAYBOOK B.11) shrinks it with
the workers: new = batch x (1 - lost/total) ** 0.8, rounded DOWN to a multiple of the new data-parallel size x
micro-batch (so the planner can split it), never above the original, and scales the learning rate by
sqrt(new/old) (the square-root rule the lr rule itself uses). Growing back to the full world restores the
original batch and learning rate.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Optional

from rayspeed.config.schema import AUTO, JobConfig


def _degrees(job: JobConfig, world: int, tp_pp: Optional[tuple[int, int]] = None) -> tuple[int, Optional[int]]:
    """(new dp, micro-batch if the job fixes it) for this world: tp and pp as the job (or its checkpoint) pins
    them, else as given (the caller's plan), else as the planner would choose them for the original batch."""
    par = job.parallel
    tp, pp = par.tp, par.pp
    if tp_pp is not None and not (isinstance(tp, int) and isinstance(pp, int)):
        tp, pp = (tp if isinstance(tp, int) else tp_pp[0]), (pp if isinstance(pp, int) else tp_pp[1])
    if not (isinstance(tp, int) and isinstance(pp, int)):
        from rayspeed.errors import ConfigError
        from rayspeed.planner import plan_job

        try:
            lay = plan_job(job, world_size=world, top_k=0).layout
            tp = tp if isinstance(tp, int) else (lay.tp if lay else 1)
            pp = pp if isinstance(pp, int) else (lay.pp if lay else 1)
        except ConfigError:  # nothing fits at the original batch: plain data parallel is the best guess
            tp, pp = (tp if isinstance(tp, int) else 1), (pp if isinstance(pp, int) else 1)
    dp = max(1, world // max(1, int(tp) * int(pp)))
    mb = par.micro_batch_size if isinstance(par.micro_batch_size, int) else None
    return dp, mb


def new_global_batch(g0: int, total: int, world: int, dp: int, micro: Optional[int]) -> tuple[int, Optional[int]]:
    """(global batch, micro-batch to use or None to let the planner choose) after losing total - world workers."""
    want = g0 * (1 - (total - world) / total) ** 0.8
    unit = dp * (micro or 1)
    if unit <= want:
        g = int(want // unit) * unit
        return min(g, g0), micro
    # Not even one micro-batch of the kept size per rank: re-plan the micro-batch (at least 1 sequence per rank).
    per_rank = max(1, int(want // dp))
    g = min(per_rank * dp, g0)
    return g, (per_rank if micro is not None else None)


def apply_batch_policy(job: JobConfig, world_size: int,
                       tp_pp: Optional[tuple[int, int]] = None) -> tuple[JobConfig, str]:
    """The job with its global batch (and learning rate) for `world_size` workers, and one line saying why.
    tp_pp: the tensor- and pipeline-parallel degrees to size the batch by where the job leaves them auto."""
    total = job.cluster.max_workers
    policy = job.resilience.batch_policy
    g0 = job.train.global_batch_size
    if policy == "keep_global" or world_size >= total:
        return job, f"batch policy {policy}: global batch {g0} kept (world {world_size}/{total})"
    lost = total - world_size
    dp, micro = _degrees(job, world_size, tp_pp)
    g, new_micro = new_global_batch(g0, total, world_size, dp, micro)
    scale = math.sqrt(g / g0)
    train: Any = replace(job.train, global_batch_size=g)
    lr_note = "lr auto (the rule sees the new batch)"
    if job.train.lr != AUTO:
        min_lr = job.train.min_lr if job.train.min_lr == AUTO else float(job.train.min_lr) * scale
        train = replace(train, lr=float(job.train.lr) * scale, min_lr=min_lr)
        lr_note = f"lr x sqrt({g}/{g0}) = x{scale:.3f}"
    par = job.parallel
    if new_micro is not None and new_micro != micro:
        par = replace(par, micro_batch_size=new_micro)
    line = (f"batch policy playbook: {lost} of {total} workers lost -> global batch {g0} x (1 - {lost}/{total})^0.8 "
            f"= {g0 * (1 - lost / total) ** 0.8:.1f}, rounded down to {g} (a multiple of dp {dp} x micro-batch "
            f"{new_micro or micro or 1}); {lr_note}")
    return replace(job, train=train, parallel=par), line
