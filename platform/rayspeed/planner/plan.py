"""plan_job / resolve / evaluate_layout: the planner's entry points."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Callable

from rayspeed.config.context_split import cp_problem, scheme_for
from rayspeed.config.layout import CHECKPOINT_MODES, LAYOUT_KEYS, Layout
from rayspeed.config.schema import AUTO, JobConfig
from rayspeed.config.validate import default_sequence_parallel, shape_split_problems
from rayspeed.errors import ConfigError
from rayspeed.planner.checkpoint_memory import checkpoint_plan
from rayspeed.planner.checkpoint_memory import explain_lines as checkpoint_explain
from rayspeed.planner.claims import build_claims
from rayspeed.planner.ep_terms import ep_problem
from rayspeed.planner.explain import render
from rayspeed.planner.hardware import GIB
from rayspeed.planner.headline import edge_headline
from rayspeed.planner.hypotheses import CAP_RULE, RuleTest, check_accumulation_cap
from rayspeed.planner.inputs import Ctx
from rayspeed.planner.memory import bytes_per_param, cp_scheme
from rayspeed.planner.pick_order import NEAR_TIE, headroom, model_error, rank
from rayspeed.planner.rules import all_rules, lr_rule
from rayspeed.planner.search import (
    Estimate,
    accumulation_cap,
    build_ctx,
    deepspeed_options,
    enumerate_layouts,
    evaluate,
    fixed_keys,
    hpz_applies,
    zero_problem,
)


@dataclass
class PlanResult:
    best: dict
    alternatives: list = field(default_factory=list)
    body: str = ""
    """The explanation below its headline."""
    rules: dict = field(default_factory=dict)
    layout: Layout | None = None
    ctx: Ctx | None = None
    headline: Callable[[], str | None] | None = None
    """The first line at the memory edge (planner/headline.py): planned only when the explanation is read, since
    it searches twice more and most plans (every attempt's, on every worker) never show it."""

    @functools.cached_property
    def explain(self) -> str:
        first = self.headline() if self.headline is not None else None
        return f"{first}\n\n{self.body}" if first else self.body

    def to_json(self) -> dict:
        """The `--json` object: plan, alternatives, explain (+ the rules, in full)."""
        return {"plan": self.best, "alternatives": self.alternatives, "explain": self.explain, "rules": self.rules}


# ---------------------------------------------------------------- search


def _diverse(ranked: list[Estimate], top_k: int) -> list[Estimate]:
    """Runner-ups that teach something: the best of each other (tp, pp, ZeRO) family first, then the rest."""
    if top_k <= 0 or len(ranked) < 2:
        return []
    best = ranked[0]
    seen = {(best.layout.tp, best.layout.cp, best.layout.pp, best.layout.zero_stage)}
    out: list[Estimate] = []
    for e in ranked[1:]:
        key = (e.layout.tp, e.layout.cp, e.layout.pp, e.layout.zero_stage)
        if key not in seen:
            seen.add(key)
            out.append(e)
        if len(out) >= top_k:
            return out
    for e in ranked[1:]:
        if len(out) >= top_k:
            break
        if e not in out:
            out.append(e)
    return sorted(out, key=lambda e: e.step_s)


def _search(cfg: JobConfig, ctx: Ctx, fixed: dict):
    """Every valid layout evaluated; the seed rules that filter (the accumulation cap) tested by the model first:
    an applied rule keeps its layouts out of the ranking, and they stay in `estimates` with their numbers."""
    en = enumerate_layouts(ctx, fixed)
    cache: dict = {}
    estimates = [evaluate(ctx, lay, cache) for lay in en.layouts]
    cap = check_accumulation_cap(ctx, estimates) if "grad_accum" not in fixed else RuleTest(
        "accumulation_cap", CAP_RULE, False, "not applied: parallel.grad_accum is fixed in the job file",
        {"max_grad_accum": accumulation_cap(ctx)})
    if cap.kept is not None:
        ranked = cap.kept
    else:
        out = {id(e) for e in cap.excluded}
        ranked = rank([e for e in estimates if id(e) not in out])
    return en, estimates, ranked, list(ctx.notes), cap


def plan_job(cfg: JobConfig, world_size: int | None = None, top_k: int = 5, profile=None, oom=None) -> PlanResult:
    """Search every valid layout for this job and cluster; raise ConfigError when none is possible.
    `profile`: a hardware-profile path or dict (default: the job's cluster.profile); `oom`: layouts that ran out
    of memory (planner.oom_feedback)."""
    ctx = build_ctx(cfg, world_size, profile=profile, oom=oom)
    fixed = fixed_keys(cfg)
    en, estimates, ranked, notes, cap = _search(cfg, ctx, fixed)
    if not ranked:
        raise ConfigError(_why_nothing(cfg, ctx, fixed, en, estimates))
    c, r = cfg.cluster, cfg.resilience
    if c.elastic:
        notes.append(f"elastic {c.min_workers}-{c.max_workers} workers: a (re)start needs at least "
                     f"{c.effective_min_workers(r.stability_threshold)} (resilience.stability_threshold "
                     f"{r.stability_threshold:g} x {c.max_workers}, not below {c.min_workers}) and waits for them up "
                     f"to resilience.capacity_wait_s ({r.capacity_wait_s:g} s); planned here for {ctx.world}")
    best = ranked[0]
    if not best.safe:
        notes.append(f"no layout fits with the memory model's margin: the chosen one needs {best.memory_text()} of "
                     f"{ctx.usable_gib:.1f} GiB usable and fits only within the model's uncertainty; the first step "
                     "compares measured and predicted peak memory")
    alts = _diverse(ranked, top_k)
    rules = all_rules(ctx, best.layout, best, ranked, estimates, cfg.train.precision,
                      cfg.resilience.collective_timeout_s, cap)
    rules["lr"]["applied"] = cfg.train.lr == AUTO
    claims = build_claims(ctx, best, ranked, estimates, cap, fixed, rules)
    counts = {"evaluated": len(estimates), "fitting": sum(1 for e in estimates if e.fits),
              "ranked": len(ranked), "excluded_by_cap": len(cap.excluded)}
    text = render(ctx, best, alts, estimates, rules, fixed, notes, cfg.name, counts, claims)
    headline = functools.partial(edge_headline, cfg, best,
                                 lambda job, world: _best_fitting(build_ctx(job, world, profile=profile), fixed))
    plan = _plan_dict(cfg, ctx, best, rules)
    plan["notes"] = notes
    plan["near_ties"] = near_ties(ranked)
    plan["claims"] = claims
    # Host memory of an async checkpoint's snapshot, and the checkpoint mode it allows.
    plan["checkpoint"] = checkpoint_plan(ctx, best.layout, sum(best.memory.values()), r.checkpoint_mode)
    text += "\n" + "\n".join(checkpoint_explain(plan["checkpoint"])) + "\n"
    return PlanResult(best=plan, alternatives=[e.to_plan() for e in alts], body=text, headline=headline, rules=rules,
                      layout=best.layout, ctx=ctx)


def _plan_dict(cfg: JobConfig, ctx: Ctx, e: Estimate, rules: dict | None = None) -> dict:
    d = e.to_plan()
    ds = deepspeed_options(ctx, e.layout)
    if rules:  # the compact part of the rules the engine applies; the rest is in PlanResult.rules
        ds.update(rules["comm_profile"]["deepspeed"])
        d["env"] = rules["comm_profile"]["env"]
        d["strategy_rule"] = rules["strategy"]["recommends"]
        d["strategy_rule_fits"] = rules["strategy"]["fits"]
        d["max_grad_accum"] = rules["accumulation_cap"]["max_grad_accum"]
        d["tf32"] = rules["precision"]["tf32"]
        d["activation_checkpointing_template"] = {k: v for k, v in rules["checkpointing"].items()
                                                  if k not in ("mode", "template")}
    d.update(world_size=ctx.world, gpu=ctx.hw.name, nodes=ctx.nodes, precision=ctx.precision, deepspeed=ds,
             cp_scheme=cp_scheme(ctx, e.layout))
    d["profile"] = {"path": ctx.profile or None, "model_error": round(model_error(ctx), 4),
                    "efficiency": dict(zip(("compute", "comm", "overhead"), ctx.efficiency))}
    d["lr"] = cfg.train.lr if cfg.train.lr != AUTO else lr_rule(ctx.global_batch, ctx.world)["lr"]
    return d


def near_ties(ranked: list[Estimate]) -> dict:
    """The layouts the time model cannot tell from the chosen one (within its own error of the fastest)."""
    if not ranked:
        return {}
    err = model_error(ranked[0].ctx)
    fastest = min(e.step_s for e in ranked)
    ties = [e for e in ranked if e.step_s <= fastest * (1 + err)]
    return {"model_error": round(err, 4), "count": len(ties),
            "layouts": [{"layout": e.layout.short(), "step_time_s": round(e.step_s, 6),
                         "headroom": round(headroom(e), 3)} for e in ties[:5]],
            "chosen_for": ("the fastest that fits with the memory margin" if ranked[0].step_s > fastest * (1 + NEAR_TIE)
                           else "fastest (simplest within 1%)")}


# ---------------------------------------------------------------- errors


def _why_nothing(cfg: JobConfig, ctx: Ctx, fixed: dict, en, estimates: list[Estimate]) -> list[str]:
    """Problems naming the key and the fix: structural first, then memory (which part, by how much, what fits)."""
    if not estimates:
        seen, out = set(), []
        for r in en.rejected:
            if r not in seen:
                seen.add(r)
                out.append(r)
        if not out:
            out.append(f"no layout of dp x cp x tp x pp = {ctx.world} satisfies the job")
        head = (f"cluster.num_workers: no valid layout for {ctx.world} workers"
                + (f" with {', '.join(f'parallel.{k}={v}' for k, v in fixed.items())}" if fixed else ""))
        return [f"{head}: " + out[0]] + out[1:6]
    least = min(estimates, key=lambda e: e.memory_gib)
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(least.memory.items(), key=lambda kv: -kv[1]) if v > 0)
    k, v = least.biggest_part()
    msg = (f"the job does not fit in memory on {ctx.world} x {ctx.hw.name} ({ctx.usable_gib:.1f} GiB usable per "
           f"{'GPU' if ctx.hw.is_gpu else 'worker'})"
           + (f" with {', '.join(f'parallel.{k2}={v2}' for k2, v2 in fixed.items())}" if fixed else "")
           + f": the smallest layout ({least.layout.short()}) needs {least.memory_gib:.1f} GiB on the worst rank, "
           f"over by {least.overshoot_gib():.1f} GiB; largest part {k} {v:.1f} GiB (GiB: {parts})")
    problems = [msg]
    if fixed:
        hint = _what_would_fit(ctx, fixed)
        if hint:
            problems.append(hint)
            return problems
    # Nothing fits at all: how many GPUs the model states alone need at ZeRO-3.
    bpp = sum(bytes_per_param(ctx.precision, ctx.grad_accum_dtype).values())
    need = math.ceil(ctx.shape.params * bpp / GIB / max(ctx.usable_gib * 0.6, 1e-9))
    problems.append(f"what would fit: more {'GPUs' if ctx.hw.is_gpu else 'workers'} (model states alone need "
                    f"{ctx.shape.params * bpp / GIB:.0f} GiB: about {need} or more with ZeRO-3), "
                    "a GPU with more memory (cluster.gpu), or a shorter model.seq_len / smaller "
                    "train.global_batch_size")
    return problems


def _best_fitting(ctx: Ctx, fixed: dict) -> Estimate | None:
    try:
        en = enumerate_layouts(ctx, fixed)
    except ConfigError:  # no valid layout for this world at all
        return None
    ranked = rank([evaluate(ctx, lay) for lay in en.layouts])
    return ranked[0] if ranked else None


def _what_would_fit(ctx: Ctx, fixed: dict) -> str | None:
    """The smallest change to the fixed keys that fits: free one key, else all of them."""
    options = []
    for key in fixed:
        e = _best_fitting(ctx, {k: v for k, v in fixed.items() if k != key})
        if e is not None:
            options.append((e.step_s, key, e))
    if options:
        options.sort(key=lambda o: o[0])
        cap = accumulation_cap(ctx)
        lines = [f"parallel.{key}={getattr(e.layout, key)} (then {e.layout.short()}, {e.memory_gib:.1f} GiB, "
                 f"{e.step_s:.3g} s/step"
                 + (f", accumulation above the cap of {cap}" if e.layout.grad_accum > cap else "")
                 + ")" for _, key, e in options[:3]]
        return "what would fit, changing one fixed key: " + "; or ".join(lines)
    e = _best_fitting(ctx, {})
    if e is not None:
        changes = [f"parallel.{k}={getattr(e.layout, k)}" for k in fixed if getattr(e.layout, k) != fixed[k]]
        return (f"what would fit: {', '.join(changes) or 'leaving these keys auto'} (best layout {e.layout.short()}, "
                f"{e.memory_gib:.1f} GiB); or set them to auto")
    return None


# ---------------------------------------------------------------- resolve / evaluate


def resolve(cfg: JobConfig, world_size: int | None = None, profile=None, oom=None) -> tuple[JobConfig, PlanResult]:
    """A new JobConfig with every auto in parallel and train filled (and cluster.gpu, and the pipeline's
    stage split parallel.stage_layers), plus the plan. `oom`: layouts that ran out of memory (planner.oom_feedback)."""
    res = plan_job(cfg, world_size, profile=profile, oom=oom)
    lay, ctx = res.layout, res.ctx
    assert lay is not None and ctx is not None  # plan_job always sets both
    fill = {k: getattr(lay, k) for k in LAYOUT_KEYS}
    fill["cp_scheme"] = cp_scheme(ctx, lay)
    if hasattr(cfg.parallel, "stage_layers"):
        fill["stage_layers"] = list(lay.stage_layers) if (lay.stage_layers and lay.pp > 1) else None
    par = dataclasses.replace(cfg.parallel, **fill)
    lr = cfg.train.lr if cfg.train.lr != AUTO else res.best["lr"]
    train = dataclasses.replace(cfg.train, precision=ctx.precision, lr=lr)
    if train.min_lr == AUTO:
        train = dataclasses.replace(train, min_lr=float(lr) * 0.1)
    elif train.min_lr > lr:  # only with lr: auto (validation refuses a fixed lr below min_lr)
        raise ConfigError(f"train.min_lr ({train.min_lr:g}) is above the learning rate lr: auto gives this job "
                          f"({lr:.3g}, {res.rules['lr']['rule']}); lower train.min_lr (or set it to auto: "
                          "lr / 10), or set train.lr")
    if getattr(train, "compile", False) == AUTO:
        # torch.compile before DeepSpeed keeps part of its gain (H200 anchor) where the engine allows it:
        # GPUs, no pipeline engine, no ZeRO-3 parameter gathers, no collectives inside tp layers.
        train = dataclasses.replace(train, compile=bool(cfg.cluster.use_gpu and ctx.hw.is_gpu and lay.pp == 1
                                                        and lay.zero_stage < 3 and lay.tp == 1))
    cluster = cfg.cluster
    if cluster.gpu == AUTO:
        cluster = dataclasses.replace(cluster, gpu=ctx.hw.name)
    return dataclasses.replace(cfg, parallel=par, train=train, cluster=cluster), res


def evaluate_layout(cfg: JobConfig, layout: dict, world_size: int | None = None, profile=None) -> dict:
    """One plan object for a given layout. Missing keys are derived (dp from the world, grad_accum from the
    batch, sequence_parallel from tp; zero_stage 0, micro_batch_size 1, checkpointing none; for pp > 1 the
    planner's stage split unless `stage_layers` gives one).
    `valid`: the layout obeys the platform's structural and topology rules (an engine could run it);
    `runnable`: this runtime builds it for this job; `fits`: runnable and it fits in memory; `reason`: why not.
    Layouts that break a rule but can still be costed (tp across nodes, ZeRO-2/3 with pp, a batch that does not
    match the job, accumulation above the cap) keep their memory and time estimates."""
    ctx = build_ctx(cfg, world_size, profile=profile)
    sh = ctx.shape
    fatal: list[str] = []  # cannot be costed
    broken: list[str] = []  # costed, but against the platform's rules (not valid)
    unbuildable: list[str] = []  # valid, but this runtime does not build it for this job
    warnings: list[str] = []
    unknown = [k for k in layout if k not in LAYOUT_KEYS and k != "stage_layers"]
    if unknown:
        warnings.append(f"ignored unknown key(s) {unknown}; expected {list(LAYOUT_KEYS) + ['stage_layers']}")
    try:
        tp = int(layout.get("tp", 1))
        pp = int(layout.get("pp", 1))
        cp = int(layout.get("cp", 1))
        ep = int(layout.get("ep", 1))
        dp = int(layout.get("dp", ctx.world // max(1, tp * pp * cp)))
        mb = int(layout.get("micro_batch_size", 1))
        ga = int(layout.get("grad_accum", max(1, ctx.global_batch // max(1, dp * mb))))
        z = int(layout.get("zero_stage", 0))
        split = layout.get("stage_layers")
        split = tuple(int(n) for n in split) if split not in (None, "", []) else None
    except (TypeError, ValueError) as exc:
        return {**{k: layout.get(k) for k in LAYOUT_KEYS}, "fits": False, "valid": False, "runnable": False,
                "reason": f"layout values must be integers: {exc}"}
    sp = layout.get("sequence_parallel", default_sequence_parallel(sh.seq_len, tp))
    sp = sp if isinstance(sp, bool) else str(sp).lower() == "true"
    ac = str(layout.get("activation_checkpointing", "none"))
    if min(dp, tp, pp, cp, ep, mb, ga) < 1:
        fatal.append("dp, cp, ep, tp, pp, micro_batch_size and grad_accum must be >= 1")
    elif ep_problem(sh, dp, ep):
        fatal.append(str(ep_problem(sh, dp, ep)))
    elif dp * cp * tp * pp != ctx.world:
        fatal.append(f"dp ({dp}) x cp ({cp}) x tp ({tp}) x pp ({pp}) = {dp * cp * tp * pp} != world size "
                     f"({ctx.world})")
    if tp >= 1 and (sh.num_heads % tp or sh.num_kv_heads % tp):
        fatal.append(f"tp {tp} does not divide model.num_heads ({sh.num_heads}) and "
                     f"model.num_kv_heads ({sh.num_kv_heads})")
    if pp > sh.num_layers:
        fatal.append(f"pp {pp} exceeds model.num_layers ({sh.num_layers}): every stage needs at least one layer")
    if split is not None and (len(split) != pp or min(split) < 1 or sum(split) != sh.num_layers):
        fatal.append(f"stage_layers {list(split)} must give pp ({pp}) stages of >= 1 layer adding up to "
                     f"model.num_layers ({sh.num_layers})")
    if z not in (0, 1, 2, 3):
        fatal.append(f"zero_stage {z} is not 0..3")
    if ac not in CHECKPOINT_MODES:
        fatal.append(f"activation_checkpointing {ac!r} is not one of {list(CHECKPOINT_MODES)}")
    lay_d = {"dp": dp, "tp": tp, "pp": pp, "zero_stage": z, "micro_batch_size": mb, "grad_accum": ga,
             "sequence_parallel": sp, "activation_checkpointing": ac, "cp": cp, "ep": ep}
    if split is not None:
        lay_d["stage_layers"] = list(split)
    if fatal:
        return {**lay_d, "fits": False, "valid": False, "runnable": False, "reason": "; ".join(fatal),
                "memory_gib_per_gpu": None, "memory_breakdown_gib": {}, "step_time_s": None,
                "tokens_per_s_per_gpu": None, "mfu": None}
    if tp > ctx.node_size:
        broken.append(f"tp {tp} spans nodes ({ctx.node_size} ranks per node): the topology rule keeps tp inside a node")
    if pp > 1 and z > 1:
        broken.append(f"zero_stage {z} with pp {pp}: DeepSpeed's pipeline engine supports ZeRO 0 or 1 only")
    if sp and tp == 1:
        broken.append("sequence_parallel needs tp > 1")
        sp = False
    if split is not None and pp == 1:
        warnings.append("stage_layers ignored with pp 1")
        split = None
    unbuildable += [f"the runtime's model builder: {p}" for p in shape_split_problems(sh, tp, sp)]
    cp_why = cp_problem(sh.seq_len, sh.num_heads, sh.num_kv_heads, max(1, tp), cp,
                        scheme_for(sh.num_heads, sh.num_kv_heads, max(1, tp), cp, ctx.cp_scheme))
    if cp_why:
        unbuildable.append(cp_why)
    zero_why = zero_problem(ctx, z)
    if zero_why:
        unbuildable.append(zero_why)
    if dp * mb * ga != ctx.global_batch:
        unbuildable.append(f"dp ({dp}) x micro_batch_size ({mb}) x grad_accum ({ga}) = {dp * mb * ga} != "
                           f"train.global_batch_size ({ctx.global_batch}); costed at {dp * mb * ga} sequences per step")
        ctx = dataclasses.replace(ctx, global_batch=dp * mb * ga)
    if ga > accumulation_cap(ctx):
        warnings.append(f"grad_accum {ga} is above the field guide's cap ({accumulation_cap(ctx)})")
    hpz = max(1, min(dp, ctx.node_size // tp)) if z == 3 and hpz_applies(ctx, tp, dp) else 1
    hpz = hpz if cp == 1 else 1
    e = evaluate(ctx, Layout(dp, tp, pp, z, mb, ga, sp, ac, hpz, stage_layers=split, cp=cp, ep=ep))
    if hpz > 1 and not e.fits:  # hierarchical partitioning only where its node-local copy fits
        e = evaluate(ctx, Layout(dp, tp, pp, z, mb, ga, sp, ac, 1, stage_layers=split, cp=cp, ep=ep))
    d = _plan_dict(cfg, ctx, e)
    d["valid"] = not broken
    d["runnable"] = not broken and not unbuildable
    reasons = broken + unbuildable + ([d["reason"]] if "reason" in d else [])
    d["fits"] = bool(e.fits and d["runnable"])
    if reasons:
        d["reason"] = "; ".join(reasons)
    if warnings:
        d["warnings"] = warnings
    return d
