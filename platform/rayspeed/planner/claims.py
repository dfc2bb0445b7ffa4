"""What `rayspeed plan --explain` asserts, as records: each claim carries the numbers it rests on and its text, so
the text is rendered from them and tests check the records against the plan's own estimates, not English.

Kinds: `chosen` (the pick and the policy that made it), `faster_not_chosen` (every fitting layout predicted faster
than the pick, with the reason it lost), `key` (per layout key: the chosen value and the best layout with each
other value), `rule` (each seed rule tested by the model, planner/hypotheses.py) and `hpz` (ZeRO++ hierarchical
partitioning, where it applies)."""

from __future__ import annotations

from rayspeed.config.layout import CHECKPOINT_MODES, LAYOUT_KEYS
from rayspeed.planner.hypotheses import RuleTest
from rayspeed.planner.inputs import Ctx
from rayspeed.planner.pick_order import HEADROOM_TIE, NEAR_TIE, spare_gib
from rayspeed.planner.search import Estimate

LISTED = 50  # faster_not_chosen claims kept in the plan (the text shows the first few)


def _pct(e: Estimate, best: Estimate) -> float:
    return round(100 * (e.step_s / best.step_s - 1), 2)


def _status(e: Estimate, excluded: set) -> str:
    if not e.fits:
        return "does_not_fit"
    if id(e) in excluded:
        return "excluded_by_rule"
    return "fits" if e.safe else "fits_within_margin"


def _numbers(e: Estimate) -> dict:
    return {"layout": e.layout.short(), "step_time_s": round(e.step_s, 6) if e.fits else None,
            "memory_gib": round(e.memory_gib, 3), "margin_gib": round(e.margin_gib, 3)}


def chosen_claim(ctx: Ctx, best: Estimate, estimates: list[Estimate], excluded: set) -> dict:
    fastest = min((e for e in estimates if e.fits), key=lambda e: e.step_s)
    safe = [e for e in estimates if e.fits and e.safe and id(e) not in excluded]
    fastest_safe = min(safe, key=lambda e: e.step_s) if safe else None
    if fastest.step_s >= best.step_s * (1 - 1e-4):  # ties in time: the pick is (one of) the fastest
        policy, text = "fastest", "the fastest fitting layout"
    elif best.safe and fastest_safe is not None and fastest_safe.step_s < best.step_s * (1 - 1e-4):
        policy = "headroom"
        text = (f"within {100 * HEADROOM_TIE:.0f}% of the fastest that fits with the memory margin "
                f"({fastest_safe.layout.short()}, {-_pct(fastest_safe, best):.1f}% faster, "
                f"{spare_gib(fastest_safe):.2f} GiB to spare): the one with the most memory to spare "
                f"({spare_gib(best):.2f} GiB of {ctx.usable_gib:.1f} usable once the margin is counted)")
    elif best.safe and not fastest.safe:
        policy = "margin"
        text = (f"the fastest that fits with the memory margin; {fastest.layout.short()} is "
                f"{-_pct(fastest, best):.1f}% faster but needs {fastest.memory_text()} of {ctx.usable_gib:.1f} usable")
    elif id(fastest) in excluded:
        policy = "rule"
        text = (f"the fastest the accumulation cap keeps; beyond the cap {fastest.layout.short()} is "
                f"{-_pct(fastest, best):.2f}% faster (the cap was tested and applied: planner/hypotheses.py)")
    else:
        policy = "simplest_within_near_tie"
        text = (f"within {100 * NEAR_TIE:.0f}% of the fastest ({fastest.layout.short()}, {-_pct(fastest, best):.2f}% "
                "faster): the simpler one (less accumulation, smaller tp and pp, lower ZeRO, less recomputation)")
    if not best.safe:
        policy, text = "within_margin_only", text + "; no layout fits with the memory margin"
    return {"kind": "chosen", **_numbers(best), "usable_gib": round(ctx.usable_gib, 3),
            "fits_with_margin": best.safe, "policy": policy, "fastest_fitting": fastest.layout.short(),
            "fastest_fitting_step_s": round(fastest.step_s, 6), "text": text}


def faster_claims(ctx: Ctx, best: Estimate, estimates: list[Estimate], excluded: set) -> list[dict]:
    """Every fitting layout predicted faster than the pick, with the reason the pick's policy passed it over."""
    out = []
    for e in sorted((x for x in estimates if x.fits and x.step_s < best.step_s * (1 - 1e-4)), key=lambda x: x.step_s):
        if best.safe and not e.safe:
            reason, why = "margin", f"more than the {ctx.usable_gib:.1f} GiB usable once its margin is counted"
        elif best.safe and id(e) not in excluded:
            reason, why = "headroom", (f"within {100 * HEADROOM_TIE:.0f}% of the chosen one, which leaves more memory "
                                       f"to spare ({spare_gib(best):.2f} GiB against {spare_gib(e):.2f})")
        elif id(e) in excluded:
            reason, why = "rule", ("excluded by the accumulation cap, which the model agreed with (its best within "
                                   "the cap is picked over its best beyond it)")
        else:
            reason, why = "near_tie", f"within {100 * NEAR_TIE:.0f}% of the chosen one, which is simpler"
        out.append({"kind": "faster_not_chosen", **_numbers(e), "faster_pct": -_pct(e, best), "reason": reason,
                    "text": f"{e.layout.short()}: {-_pct(e, best):.1f}% faster, {e.memory_text()}: {why}"})
    return out


def _order(v) -> tuple:
    return (str(type(v)), CHECKPOINT_MODES.index(v) if isinstance(v, str) and v in CHECKPOINT_MODES else v)


def _what_it_is(key: str, best: Estimate) -> str:
    """What the chosen value means beyond the numbers (the structural facts behind it)."""
    lay, ctx = best.layout, best.ctx
    if key == "tp" and lay.tp > 1:
        return f"within one node ({ctx.node_size} ranks, {ctx.hw.intra_node_gbps:.0f} GB/s links); "
    if key == "sequence_parallel" and lay.tp > 1 and not lay.sequence_parallel and ctx.shape.seq_len % lay.tp:
        return (f"off, model.seq_len ({ctx.shape.seq_len}) does not divide by tp ({lay.tp}) (auto is true iff tp > 1 "
                "and tp divides model.seq_len); ")
    if key == "grad_accum":
        return (f"global batch {ctx.global_batch} = dp {lay.dp} x micro-batch {lay.micro_batch_size} x "
                f"{lay.grad_accum}; ")
    return ""


def key_claims(best: Estimate, ranked: list[Estimate], estimates: list[Estimate], excluded: set,
               fixed: dict) -> list[dict]:
    """Per layout key, the best layout with each other value: the first in the pick's own order among the ranked,
    else the fastest excluded by a rule, else the smallest that does not fit."""
    position = {id(e): i for i, e in enumerate(ranked)}
    out = []
    for key in LAYOUT_KEYS:
        chosen = getattr(best.layout, key)
        claim: dict = {"kind": "key", "key": key, "chosen": chosen, "fixed": key in fixed, "alternatives": []}
        if key in fixed:
            claim["text"] = f"{key} = {chosen}: fixed in the job file"
            out.append(claim)
            continue
        by_value: dict = {}
        for e in estimates:
            v = getattr(e.layout, key)
            if v != chosen:
                by_value.setdefault(v, []).append(e)
        parts = []
        for v in sorted(by_value, key=_order):
            group = by_value[v]
            ranked_here = [e for e in group if id(e) in position]
            if ranked_here:
                e = min(ranked_here, key=lambda x: position[id(x)])
            else:
                rule_out = [e for e in group if e.fits and id(e) in excluded]
                e = (min(rule_out, key=lambda x: x.step_s) if rule_out
                     else min(group, key=lambda x: x.memory_gib))
            status = _status(e, excluded)
            alt = {"value": v, "status": status, **_numbers(e), "slower_pct": _pct(e, best) if e.fits else None}
            claim["alternatives"].append(alt)
            if status == "fits":
                parts.append(f"{v}: {alt['slower_pct']:+.1f}%")
            elif status == "fits_within_margin":
                parts.append(f"{v}: {alt['slower_pct']:+.1f}% but only within the memory margin ({e.memory_text()})")
            elif status == "excluded_by_rule":
                parts.append(f"{v}: excluded by the accumulation cap ({alt['slower_pct']:+.1f}%, {e.memory_text()})")
            else:
                parts.append(f"{v}: does not fit (>= {e.memory_gib:.1f} GiB)")
        faster = [a for a in claim["alternatives"] if a["status"] == "fits" and a["slower_pct"] < 0]
        if not claim["alternatives"]:
            reason = "the only valid value"
        elif not best.safe:  # nothing fits with the margin: the pick is the fastest that fits at all
            reason = "the fastest value that fits (no layout fits with the memory margin)"
        elif faster:
            reason = (f"a faster value ({faster[0]['value']}) is within {100 * HEADROOM_TIE:.0f}%: this one leaves "
                      "more memory to spare")
        elif any(a["status"] in ("fits_within_margin", "excluded_by_rule") and a["slower_pct"] < 0
                 for a in claim["alternatives"]):
            reason = "the fastest value that fits with the memory margin and no applied rule excludes"
        else:
            reason = "the fastest value that fits with the memory margin"
        claim["reason"] = reason
        claim["text"] = (f"{key} = {chosen}: {_what_it_is(key, best)}{reason}"
                         + (f" (best with {key} = " + "; ".join(parts) + ")" if parts else ""))
        out.append(claim)
    return out


def hpz_claim(best: Estimate, estimates: list[Estimate]) -> dict | None:
    """ZeRO++ hierarchical partitioning where the search offered it (ZeRO-3, > 64 GPUs, dp across nodes)."""
    with_hpz = [e for e in estimates if e.layout.hpz > 1]
    if not with_hpz:
        return None
    if best.layout.hpz > 1:
        return {"kind": "hpz", "chosen": True, "layout": best.layout.short(),
                "text": f"ZeRO++ hierarchical partitioning chosen (zero_hpz_partition_size={best.layout.hpz})"}
    fitting = [e for e in with_hpz if e.fits]
    if fitting:
        e = min(fitting, key=lambda x: x.step_s)
        verdict = (f"its best ({e.layout.short()}) is {_pct(e, best):+.1f}%, {e.memory_text()}"
                   + ("" if e.safe else ", only within the memory margin"))
    else:
        e = min(with_hpz, key=lambda x: x.memory_gib)
        verdict = f"its node-local weight copy does not fit: the smallest needs {e.memory_gib:.1f} GiB"
    return {"kind": "hpz", "chosen": False, **_numbers(e), "fits": e.fits, "fits_with_margin": e.safe,
            "slower_pct": _pct(e, best) if e.fits else None,
            "text": f"ZeRO++ hierarchical partitioning evaluated, not chosen: {verdict}"}


def rule_claims(cap: RuleTest, rules: dict) -> list[dict]:
    """The seed rules tested as hypotheses, one claim each: the accumulation cap, the strategy by size and (on GPU
    clusters of 9-64) the NCCL tree."""
    strategy = rules["strategy"]
    out = [{"kind": "rule", **cap.as_dict(), "text": f"accumulation cap: {cap.why}"},
           {**{k: v for k, v in strategy.items() if k not in ("note", "applied", "rule")}, "kind": "rule",
            "rule": "strategy", "statement": strategy["rule"], "applied": strategy.get("applied", False),
            "text": f"strategy by size: {strategy['note']}"}]
    tree = rules["comm_profile"].get("nccl_algo_test")
    if tree:
        out.append({"kind": "rule", **tree, "text": f"NCCL_ALGO=Tree: {tree['why']}"})
    return out


def build_claims(ctx: Ctx, best: Estimate, ranked: list[Estimate], estimates: list[Estimate], cap: RuleTest,
                 fixed: dict, rules: dict) -> list[dict]:
    excluded = {id(e) for e in cap.excluded}
    claims = [chosen_claim(ctx, best, estimates, excluded)]
    claims += faster_claims(ctx, best, estimates, excluded)[:LISTED]
    claims += key_claims(best, ranked, estimates, excluded, fixed)
    rule = rule_claims(cap, rules)
    claims.append(rule[0])
    hpz = hpz_claim(best, estimates)
    if hpz:
        claims.append(hpz)
    return claims + rule[1:]
