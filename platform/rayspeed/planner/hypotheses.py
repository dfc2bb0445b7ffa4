"""The field guide's seed rules as hypotheses the time and memory model tests, not filters: the accumulation cap, the
NCCL algorithm table and the strategy-by-size table. Each test returns a `RuleTest` saying whether the rule was
applied and why, with the numbers it rests on; a layout a rule excludes is reported as excluded by that rule, with
its memory and time, never as "does not fit". (The learning-rate rule is no question for a time/memory model: it
stays advice with its source, rules.lr_rule.)"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rayspeed.config.layout import Layout
from rayspeed.planner.inputs import Ctx
from rayspeed.planner.pick_order import NEAR_TIE, rank
from rayspeed.planner.search import Estimate, accumulation_cap, beyond_cap
from rayspeed.planner.timing import step_time

CAP_RULE = "max_grad_accum = floor(2048 / (params_in_billions * gpus^0.33))"
TREE_RULE = "8-64 GPUs: NCCL_ALGO=Tree"
STRATEGY_RULE = "< 10B: pure DP; 10-100B: PP with 2 stages below 32 GPUs, else DP + TP (2D); > 100B: 3D (DP x PP x TP)"


@dataclass
class RuleTest:
    rule: str
    statement: str  # the rule as the field guide states it
    applied: bool
    why: str  # one line, with the numbers
    numbers: dict = field(default_factory=dict)
    excluded: list = field(default_factory=list)  # estimates the applied rule keeps out of the ranking
    kept: list | None = None  # an applied rule's remaining estimates, ranked (the search's ranking: made once)

    def as_dict(self) -> dict:
        return {"rule": self.rule, "statement": self.statement, "applied": self.applied, "why": self.why,
                **self.numbers, "excluded": len(self.excluded)}


def _brief(e: Estimate) -> dict:
    return {"layout": e.layout.short(), "step_time_s": round(e.step_s, 6), "memory_gib": round(e.memory_gib, 3),
            "margin_gib": round(e.margin_gib, 3), "fits": e.fits, "fits_with_margin": e.safe}


def check_accumulation_cap(ctx: Ctx, estimates: list[Estimate]) -> RuleTest:
    """The cap says that more accumulation than it allows is not worth it. Applied when the model agrees: the
    best layout within the cap is the one the planner would pick over the best one beyond it (faster, or within
    NEAR_TIE and simpler, or the only one of the two that fits with the margin)."""
    cap = accumulation_cap(ctx)
    above = [e for e in estimates if beyond_cap(ctx, e.layout)]
    nums: dict = {"max_grad_accum": cap}
    if not above:
        most = max((e.layout.grad_accum for e in estimates), default=0)
        return RuleTest("accumulation_cap", CAP_RULE, False,
                        f"excludes nothing: the most accumulation this job allows ({most} micro-batches) is within it",
                        nums)
    within = rank([e for e in estimates if not beyond_cap(ctx, e.layout)])
    over = rank(above)
    nums["beyond_cap_layouts"] = len(above)
    if over:
        nums["best_beyond_cap"] = _brief(over[0])
    if within:
        nums["best_within_cap"] = _brief(within[0])
    if not over:
        return RuleTest("accumulation_cap", CAP_RULE, True,
                        f"applied: none of the {len(above)} layouts beyond grad_accum {cap} fits", nums, above, within)
    if not within:
        return RuleTest("accumulation_cap", CAP_RULE, False,
                        f"not applied: no layout within grad_accum {cap} fits; beyond it {over[0].layout.short()} does "
                        f"({over[0].memory_text()}, {over[0].step_s:.4g} s)", nums)
    w, b = within[0], over[0]
    delta = 100 * (b.step_s / w.step_s - 1)
    if rank([w, b])[0] is w:
        return RuleTest("accumulation_cap", CAP_RULE, True,
                        f"applied: the model agrees; the best beyond the cap ({b.layout.short()}, {b.step_s:.4g} s, "
                        f"{b.memory_text()}) is {delta:+.1f}% against the best within it", nums, above, within)
    why = ("it fits with the memory margin and the best within the cap does not" if b.safe and not w.safe
           else f"it is {-delta:.1f}% faster than the best within the cap ({w.layout.short()}, {w.step_s:.4g} s)")
    return RuleTest("accumulation_cap", CAP_RULE, False,
                    f"not applied: the model disagrees; beyond the cap {b.layout.short()} ({b.step_s:.4g} s, "
                    f"{b.memory_text()}): {why}", nums)


def check_nccl_tree(ctx: Ctx, lay: Layout, best_step_s: float | None = None) -> RuleTest:
    """The table's NCCL_ALGO=Tree for 9-64 GPUs. NCCL_ALGO is one setting per process, so it binds every
    communicator of the job (tp groups inside a node included): the step is predicted with every all-reduce as a
    tree and set only when that is faster than NCCL's own per-call choice, which already takes the tree wherever
    its cost model prefers one."""
    if not ctx.hw.is_gpu:
        return RuleTest("nccl_algo", TREE_RULE, False, "not applicable: CPU workers use gloo")
    if not 8 < ctx.world <= 64:
        return RuleTest("nccl_algo", TREE_RULE, False, f"not applicable: the table says Tree for 9-64 GPUs only "
                        f"({ctx.world} here); NCCL picks per call")
    default = best_step_s if best_step_s is not None else step_time(ctx, lay).step_s
    forced = step_time(dataclasses.replace(ctx, nccl_algo="tree"), lay).step_s
    nums = {"step_time_s_nccl_choice": round(default, 6), "step_time_s_tree_forced": round(forced, 6)}
    delta = 100 * (forced / default - 1)
    if forced < default * (1 - NEAR_TIE):
        return RuleTest("nccl_algo", TREE_RULE, True, f"applied: Tree for every all-reduce is predicted {-delta:.1f}% "
                        f"faster ({forced:.4g} s vs {default:.4g} s with NCCL's own choice)", nums)
    return RuleTest("nccl_algo", TREE_RULE, False,
                    f"not applied: forcing Tree on every all-reduce (the tp groups inside a node too) is predicted "
                    f"{delta:+.1f}% ({forced:.4g} s vs {default:.4g} s with NCCL's own per-call choice, which already "
                    f"takes trees where they pay); NCCL_ALGO is left unset", nums)


def check_strategy(ctx: Ctx, best: Estimate, ranked: list[Estimate], all_est: list[Estimate], name: str,
                  pred) -> RuleTest:
    """The strategy-by-size table as a hypothesis: its family's best layout against the chosen one. It never
    restricts the search: when the model finds another family faster, that one is chosen and this says by how
    much."""
    members = [e for e in ranked if pred(e.layout)]
    statement = STRATEGY_RULE
    nums: dict = {"recommends": name}
    if not members:
        possible = [e for e in all_est if pred(e.layout)]
        if possible:
            least = min(possible, key=lambda e: e.memory_gib)
            return RuleTest("strategy", statement, False, f"not applied: no layout of its family fits; the smallest "
                            f"({least.layout.short()}) needs {least.memory_text()} of {ctx.usable_gib:.1f} usable",
                            nums)
        return RuleTest("strategy", statement, False, "not applied: no layout of its family is possible for this "
                        "world size, model shape and the keys fixed in the job file", nums)
    fam = members[0]
    nums["rule_best"] = _brief(fam)
    if pred(best.layout):
        return RuleTest("strategy", statement, True, "applied: the model agrees; the chosen layout is of its family",
                        nums)
    delta = 100 * (fam.step_s / best.step_s - 1)
    nums["rule_best_slowdown"] = round(fam.step_s / best.step_s - 1, 4)
    return RuleTest("strategy", statement, False, f"not applied: the model disagrees; the family's best "
                    f"({fam.layout.short()}, {fam.memory_text()}) is predicted {delta:+.1f}% against the chosen one",
                    nums)
