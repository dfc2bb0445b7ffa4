"""One attempt's plan, made once: the job as submitted, the metadata of the checkpoint this attempt resumes and the
world it got -> the resolved job, the planner's plan, the concrete layout and the notes that explain it (tp and
pp pinned to the checkpoint, the batch policy after a resize, a ZeRO stage re-planned).

    attempt = plan_attempt(job, meta, world_size)
    attempt.cfg, attempt.plan, attempt.layout, attempt.notes

Pure planning (no torch): the planner runs once, and a second time only where the first answer is an input of the
second (a shrunk world's batch policy without a checkpoint to take tp and pp from; a checkpoint's ZeRO stage that
no longer fits), each said in the notes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from rayspeed.config.layout import Layout
from rayspeed.config.schema import AUTO, JobConfig
from rayspeed.errors import ConfigError
from rayspeed.train.batch_policy import apply_batch_policy


@dataclass(frozen=True)
class AttemptPlan:
    cfg: JobConfig
    """The job with every auto resolved for this attempt's world."""
    plan: Any
    """The planner's Plan (rayspeed.planner.plan)."""
    layout: Layout
    """dp, tp, pp, ZeRO stage, micro-batch, accumulation: concrete ints."""
    notes: tuple[str, ...]
    """What shaped it, one line each (logged once per attempt)."""
    plans_made: int
    """How many times the planner ran for it (1, or 2 where the notes say why)."""


def pin_model_parallel(job: JobConfig, meta: Optional[dict[str, Any]],
                       keys: tuple[str, ...] = ("tp", "pp", "zero_stage")) -> JobConfig:
    """On resume, tp, pp (a model-parallel reshard is not a restart's job) and the ZeRO stage (its partitions are
    what the checkpoint holds) stay what the checkpoint was written with, where the job leaves them auto; dp and
    accumulation are re-planned for the new world. A mixture of experts' ep stays too where the checkpoint's ZeRO
    stage (0 or 3) or its tp (> 1) carries its expert shards to no other ep
    (rayspeed.checkpoint.resume.refuse_expert_conversion)."""
    if not meta:
        return job
    old = meta.get("layout") or {}
    par = job.parallel
    pinned: dict[str, Any] = {k: int(old[k]) for k in keys if getattr(par, k) == AUTO and k in old}
    if par.ep == AUTO and int(old.get("ep", 1)) > 1 and (int(old.get("zero_stage", 0)) in (0, 3)
                                                          or int(old.get("tp", 1)) > 1):
        pinned["ep"] = int(old["ep"])
    if "pp" in pinned and old.get("stage_layers") and par.stage_layers is None:  # the pipeline's split too
        pinned["stage_layers"] = [int(n) for n in old["stage_layers"]]
    return dataclasses.replace(job, parallel=dataclasses.replace(par, **pinned)) if pinned else job


def _plan_pinned(job: JobConfig, meta: Optional[dict[str, Any]], world: int, notes: list[str],
                 oom: Any = None) -> tuple[Any, ...]:
    """(cfg, plan, plans made): tp, pp and the ZeRO stage pinned to the checkpoint; when its ZeRO stage no longer
    fits, the planner chooses one (the checkpoint is then converted or, from ZeRO-0, its weights carried over)."""
    from rayspeed.planner import resolve

    try:
        cfg, plan = resolve(pin_model_parallel(job, meta), world_size=world, oom=oom)
        return cfg, plan, 1
    except ConfigError:
        if not meta or job.parallel.zero_stage != AUTO:
            raise
    cfg, plan = resolve(pin_model_parallel(job, meta, keys=("tp", "pp")), world_size=world, oom=oom)
    old = (meta.get("layout") or {}).get("zero_stage")
    notes.append(f"resume: ZeRO-{old} of the checkpoint does not fit {world} workers; re-planned to "
                 f"ZeRO-{cfg.parallel.zero_stage}")
    return cfg, plan, 2


def plan_attempt(job: JobConfig, meta: Optional[dict[str, Any]], world: int,
                 ooms: Optional[list[dict[str, Any]]] = None) -> AttemptPlan:
    """The plan of one attempt (see the module doc). `ooms`: this submission's out-of-memory records
    (rayspeed.train.oom): their layouts are refused and the memory model corrected (rayspeed.planner.oom_feedback)."""
    from rayspeed.planner import resolve
    from rayspeed.planner.oom_feedback import OomFeedback

    oom = OomFeedback.of(ooms or [])
    notes: list[str] = []
    pinned = pin_model_parallel(job, meta, keys=("tp", "pp"))
    if pinned is not job:
        notes.append(f"resume: tp {pinned.parallel.tp}, pp {pinned.parallel.pp} kept from the checkpoint")
    made = 0
    tp_pp: Optional[tuple[int, int]] = None
    first: Optional[tuple[Any, Any]] = None
    shrunk = world < job.cluster.max_workers and job.resilience.batch_policy != "keep_global"
    if shrunk and not (isinstance(pinned.parallel.tp, int) and isinstance(pinned.parallel.pp, int)):
        # The batch policy sizes the batch by dp: take tp and pp from the plan at the original batch.
        try:
            first, made = resolve(pin_model_parallel(pinned, meta), world_size=world, oom=oom), 1
            resolved = first[0].parallel
            assert isinstance(resolved.tp, int) and isinstance(resolved.pp, int)  # resolve() fills every auto
            tp_pp = (resolved.tp, resolved.pp)
        except ConfigError:  # nothing fits at the original batch: plain data parallel is the best guess
            tp_pp = (1, 1)
    policy_job, line = apply_batch_policy(pinned, world, tp_pp=tp_pp)
    notes.append(line)
    if first is not None and policy_job.train.global_batch_size == job.train.global_batch_size:
        cfg, plan = first
    else:
        if first is not None:
            notes.append("re-planned for the new global batch (the first plan sized it)")
        cfg, plan, n = _plan_pinned(policy_job, meta, world, notes, oom)
        made += n
    if oom:
        notes.append(replan_line(job, ooms or [], cfg, plan))
    return AttemptPlan(cfg=cfg, plan=plan, layout=Layout.from_parallel(cfg.parallel), notes=tuple(notes),
                       plans_made=made)


def replan_line(job: JobConfig, ooms: list[dict[str, Any]], cfg: JobConfig, plan: Any) -> str:
    """The one line that says why this attempt's layout is not the planner's first: what ran out of memory, what
    the model now adds, what was chosen, and the keys the job fixed (never changed)."""
    from rayspeed.planner.search import fixed_keys
    from rayspeed.train.oom import describe

    lay = Layout.from_parallel(cfg.parallel)
    added = (plan.best.get("memory_breakdown_gib") or {}).get("measured_oom")
    fixed = sorted(k for k in fixed_keys(job) if k in ("dp", "tp", "pp", "zero_stage", "micro_batch_size",
                                                         "grad_accum", "activation_checkpointing", "cp", "ep"))
    return (f"re-planned after running out of memory ({len(ooms)} of resilience.oom_replans "
            f"{job.resilience.oom_replans}): {'; '.join(describe(r) for r in ooms)} refused"
            + (f"; the memory model adds {added:.2f} GiB measured to layouts of that kind" if added else "")
            + f"; now dp {lay.dp} tp {lay.tp} pp {lay.pp} ZeRO-{lay.zero_stage} micro-batch {lay.micro_batch_size}"
            f" x {lay.grad_accum}, activation checkpointing {lay.activation_checkpointing}"
            + (f"; kept as the job fixes them: {', '.join(fixed)}" if fixed else ""))
