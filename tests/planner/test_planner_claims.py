"""`rayspeed plan --explain` is built from claims (planner/claims.py): each statement a record with the numbers it
rests on. These tests check the records against the plan's own estimates for the shipped configs and the
Llama-3-8B/70B shapes: the chosen layout is the fastest fitting one unless a stated policy says otherwise, every
faster fitting layout is listed with its reason, the per-key statements (recomputation modes included) and the
ZeRO++ and seed-rule statements match the numbers; the seed rules are hypotheses, never filters."""

import os
import re

import pytest

from rayspeed.config.layout import LAYOUT_KEYS
from rayspeed.config.load import load
from rayspeed.planner import plan_job
from rayspeed.planner.pick_order import HEADROOM_TIE, NEAR_TIE, spare_gib
from rayspeed.planner.search import build_ctx, enumerate_layouts, evaluate, fixed_keys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")
L70B = os.path.join(CONFIGS, "llama-70b-64xh100.yaml")
L1B = os.path.join(CONFIGS, "llama-1b-8xh100.yaml")
# Llama-3-8B and -70B shapes (config.json of the published checkpoints): 128256 vocabulary, GQA with 8 kv heads.
LLAMA3_8B = ["model.hidden_size=4096", "model.num_layers=32", "model.num_heads=32", "model.num_kv_heads=8",
             "model.ffn_hidden_size=14336", "model.vocab_size=128256", "model.seq_len=8192"]
LLAMA3_70B = ["model.vocab_size=128256", "model.seq_len=8192"]

CASES = {
    "llama-1b@8": (L1B, [], 8),
    "llama-7b-16xh200@16": (os.path.join(CONFIGS, "llama-7b-16xh200.yaml"), [], 16),
    "llama-70b@64": (L70B, [], 64),
    "llama-70b@512": (L70B, [], 512),
    "tiny-cpu": (os.path.join(CONFIGS, "tiny-cpu.yaml"), [], None),
    "llama3-8b@8": (L1B, LLAMA3_8B + ["train.global_batch_size=128"], 8),
    "llama3-8b@64": (L1B, LLAMA3_8B + ["train.global_batch_size=512"], 64),
    "llama3-70b@64": (L70B, LLAMA3_70B + ["train.global_batch_size=256"], 64),
    "llama3-70b@512": (L70B, LLAMA3_70B + ["train.global_batch_size=1024"], 512),
    # Nothing fits with the memory margin here: the pick is the fastest that fits at all, and says so.
    "qwen3-30b-a3b@8": (L70B, ["model={pretrained: %s, init: random, seq_len: 4096}"
                               % os.path.join(CONFIGS, "models", "qwen3-30b-a3b"), "cluster.num_workers=8",
                               "cluster.num_nodes=1", "train.global_batch_size=32"], 8),
}
_PLANS: dict = {}


def _plan(name):
    if name not in _PLANS:
        path, sets, world = CASES[name]
        cfg = load(path, sets)
        ctx = build_ctx(cfg, world)
        estimates = [evaluate(ctx, lay) for lay in enumerate_layouts(ctx, fixed_keys(cfg)).layouts]
        _PLANS[name] = (plan_job(cfg, world), estimates, ctx)
    return _PLANS[name]


def _claims(res, kind):
    return [c for c in res.best["claims"] if c["kind"] == kind]


# Layout.short(): "dp256 tp2+sp pp1 zero3 hpz4 mb4 ga1 ckpt=selective" (cp, ep, stages and hpz only when used).
_SHORT = re.compile(r"dp(?P<dp>\d+)(?: cp(?P<cp>\d+))?(?: ep(?P<ep>\d+))? tp(?P<tp>\d+)(?P<sp>\+sp)? pp(?P<pp>\d+)"
                    r"(?: stages=(?P<stages>[\d/]+))? zero(?P<zero>\d)(?: hpz(?P<hpz>\d+))? mb(?P<mb>\d+) ga(?P<ga>\d+)"
                    r" ckpt=(?P<ckpt>\w+)")


def _layout_fields(short: str) -> dict:
    m = _SHORT.fullmatch(short)
    assert m, f"not a layout: {short!r}"
    g = m.groupdict()
    return {"dp": int(g["dp"]), "tp": int(g["tp"]), "pp": int(g["pp"]), "zero_stage": int(g["zero"]),
            "micro_batch_size": int(g["mb"]), "grad_accum": int(g["ga"]), "sequence_parallel": bool(g["sp"]),
            "activation_checkpointing": g["ckpt"], "cp": int(g["cp"] or 1), "ep": int(g["ep"] or 1),
            "hpz": int(g["hpz"] or 1),
            "stage_layers": [int(n) for n in g["stages"].split("/")] if g["stages"] else None}


def _plan_layout(best: dict) -> dict:
    """The layout a plan carries: its layout keys, ZeRO++'s partition size in its DeepSpeed settings, the split."""
    return {**{k: best[k] for k in LAYOUT_KEYS},
            "hpz": (best.get("deepspeed") or {}).get("zero_hpz_partition_size", 1),
            "stage_layers": best.get("stage_layers")}


@pytest.mark.parametrize("name", list(CASES))
def test_the_chosen_layout_is_the_fastest_fitting_one_unless_a_stated_policy_says_otherwise(name):
    res, estimates, ctx = _plan(name)
    (chosen,) = _claims(res, "chosen")
    best_s = res.best["step_time_s"]
    # The claim names its layout in short form; the plan carries the same layout as fields.
    assert _layout_fields(chosen["layout"]) == _plan_layout(res.best), chosen["layout"]
    assert chosen["step_time_s"] == res.best["step_time_s"]
    assert chosen["fits_with_margin"] == res.best["fits_with_margin"]
    fitting = [e for e in estimates if e.fits]
    safe = [e for e in fitting if e.safe]
    if safe:  # the pick fits with the memory margin whenever any layout does
        assert res.best["fits_with_margin"] and chosen["fits_with_margin"]
        assert res.best["memory_gib_per_gpu"] + res.best["memory_margin_gib"] <= res.best["usable_memory_gib"] + 1e-3
        # ... nothing that fits with the margin is faster beyond the headroom band, and within it none has more
        # memory to spare
        assert min(e.step_s for e in safe) >= best_s / (1 + HEADROOM_TIE) - 1e-6
        fastest_safe = min(e.step_s for e in safe)
        band = [e for e in safe if e.step_s <= fastest_safe * (1 + HEADROOM_TIE)]
        spare = res.best["usable_memory_gib"] - res.best["memory_gib_per_gpu"] - res.best["memory_margin_gib"]
        assert max(spare_gib(e) for e in band) <= spare + 2e-3
    faster = [e for e in fitting if e.step_s < best_s * (1 - 1e-4)]  # the plan's times are rounded
    if chosen["policy"] == "fastest":
        assert not faster
    elif chosen["policy"] == "margin":
        assert faster and all(not e.safe for e in faster if e.step_s < best_s / (1 + HEADROOM_TIE))
    elif chosen["policy"] == "headroom":  # a faster one fits with the margin but leaves less to spare (above)
        assert any(e.safe for e in faster)
    lo, hi = res.best["memory_range_gib"]
    assert lo < res.best["memory_gib_per_gpu"] < hi


@pytest.mark.parametrize("name", list(CASES))
def test_every_faster_fitting_layout_is_listed_with_its_reason(name):
    res, estimates, ctx = _plan(name)
    best_s = res.best["step_time_s"]
    listed = _claims(res, "faster_not_chosen")
    faster = [e for e in estimates if e.fits and e.step_s < best_s * (1 - 1e-4)]
    assert len(listed) == min(len(faster), 50)
    for c in listed:
        assert c["step_time_s"] < best_s and c["faster_pct"] > 0
        if c["reason"] == "margin":
            assert c["memory_gib"] + c["margin_gib"] > ctx.usable_gib
        elif c["reason"] == "headroom":  # fits with the margin, within the band, with less to spare
            assert c["step_time_s"] >= best_s / (1 + HEADROOM_TIE) - 1e-6
            chosen_top = res.best["memory_gib_per_gpu"] + res.best["memory_margin_gib"]
            assert c["memory_gib"] + c["margin_gib"] >= chosen_top - 2e-3
        elif c["reason"] == "near_tie":  # nothing fits with the margin: the simpler within 1%
            assert not res.best["fits_with_margin"] and c["step_time_s"] >= best_s / (1 + NEAR_TIE) - 1e-6
        else:
            assert c["reason"] == "rule"
    if listed:
        assert "faster layouts not chosen" in res.explain and listed[0]["text"] in res.explain


@pytest.mark.parametrize("name", list(CASES))
def test_per_key_statements_match_the_numbers(name):
    res, estimates, ctx = _plan(name)
    best_s = res.best["step_time_s"]
    for c in _claims(res, "key"):
        assert c["text"] in res.explain
        if c["fixed"]:
            continue
        if not res.best["fits_with_margin"]:  # then no value "fits with the memory margin"
            assert c["reason"] in ("the only valid value",
                                   "the fastest value that fits (no layout fits with the memory margin)"), c["text"]
        for alt in c["alternatives"]:
            if alt["status"] == "fits":  # fits with the margin: never faster beyond the headroom band
                assert alt["step_time_s"] >= best_s / (1 + HEADROOM_TIE) - 1e-6, (c["key"], alt)
                assert alt["memory_gib"] + alt["margin_gib"] <= ctx.usable_gib + 1e-3
            elif alt["status"] == "does_not_fit":
                # no layout with this value fits: the statement is about all of them
                value = alt["value"]
                assert not any(e.fits for e in estimates if getattr(e.layout, c["key"]) == value), (c["key"], value)
        if c["key"] == "activation_checkpointing":
            faster = [a for a in c["alternatives"] if a["status"] == "fits" and a["slower_pct"] < 0]
            assert ("within" in c["reason"]) == bool(faster)
            assert "the cheapest mode" not in c["text"]


@pytest.mark.parametrize("name", ["llama-70b@64", "llama-70b@512", "llama3-70b@64", "llama3-70b@512"])
def test_70b_plans_consider_and_report_pipeline_layouts(name):
    res, estimates, ctx = _plan(name)
    (pp,) = [c for c in _claims(res, "key") if c["key"] == "pp"]
    reported = {a["value"]: a for a in pp["alternatives"]}
    if res.best["pp"] > 1:
        reported[res.best["pp"]] = {"status": "fits", "step_time_s": res.best["step_time_s"]}
    deep = [v for v, a in reported.items() if v > 1 and a["status"] in ("fits", "fits_within_margin",
                                                                        "excluded_by_rule")]
    assert deep, pp  # pipelines are costed, chosen or not, with their numbers
    for v in deep:
        assert reported[v]["step_time_s"] > 0
    for v, a in reported.items():
        if a["status"] == "does_not_fit":
            assert f"{v}: does not fit" in pp["text"]
            assert not any(e.fits for e in estimates if e.layout.pp == v)


@pytest.mark.parametrize("name", list(CASES))
def test_seed_rules_are_hypotheses_with_their_numbers(name):
    res, estimates, ctx = _plan(name)
    cap = res.rules["accumulation_cap"]
    best_s = res.best["step_time_s"]
    if cap["applied"] and "best_beyond_cap" in cap:  # the model agreed: the cap's side is no slower
        assert cap["best_beyond_cap"]["step_time_s"] >= cap["best_within_cap"]["step_time_s"] * (1 - NEAR_TIE)
        assert res.best["grad_accum"] <= cap["max_grad_accum"]
    if not cap["applied"] and "best_beyond_cap" in cap and "best_within_cap" in cap:
        assert cap["best_beyond_cap"]["step_time_s"] < cap["best_within_cap"]["step_time_s"] or (
            cap["best_beyond_cap"]["fits_with_margin"] and not cap["best_within_cap"]["fits_with_margin"])
    assert "does not fit (>=" not in cap["why"]
    assert "11672245" not in res.explain  # a cap no layout reaches is not printed as a number
    tree = res.rules["comm_profile"].get("nccl_algo_test")
    if tree:
        assert tree["applied"] == ("NCCL_ALGO" in res.best["env"])
        assert tree["applied"] == (tree["step_time_s_tree_forced"] < tree["step_time_s_nccl_choice"] * (1 - NEAR_TIE))
        assert tree["step_time_s_nccl_choice"] == pytest.approx(best_s, rel=1e-6)
    else:
        assert "NCCL_ALGO" not in res.best["env"]
    strategy = [c for c in _claims(res, "rule") if c["rule"] == "strategy"]
    assert len(strategy) == 1
    if "rule_best_slowdown" in strategy[0]:
        assert strategy[0]["rule_best_slowdown"] == pytest.approx(
            strategy[0]["rule_best"]["step_time_s"] / best_s - 1, abs=1e-3)


def test_an_applied_cap_reports_what_it_excludes_as_excluded_not_as_too_big():
    res, estimates, ctx = _plan("llama-7b-16xh200@16")
    cap = res.rules["accumulation_cap"]
    assert cap["applied"] and cap["excluded"] > 0
    assert f"{cap['excluded']} excluded by the accumulation cap" in res.explain
    ga = [c for c in _claims(res, "key") if c["key"] == "grad_accum"][0]
    beyond = [a for a in ga["alternatives"] if a["value"] > cap["max_grad_accum"]]
    assert beyond and any(a["status"] == "excluded_by_rule" for a in beyond)
    for a in beyond:
        if a["status"] == "excluded_by_rule":
            assert a["step_time_s"] and f"{a['value']}: excluded by the accumulation cap" in ga["text"]


@pytest.mark.parametrize("name", ["llama-70b@512", "llama3-70b@512"])
def test_zero_plus_plus_statement_matches_the_numbers(name):
    res, estimates, ctx = _plan(name)
    hpz = _claims(res, "hpz")
    with_hpz = [e for e in estimates if e.layout.hpz > 1]
    if not with_hpz:
        assert not hpz
        return
    (c,) = hpz
    if c["chosen"]:
        assert res.best["deepspeed"].get("zero_hpz_partition_size", 1) > 1
        return
    fitting = [e for e in with_hpz if e.fits]
    if fitting:
        e = min(fitting, key=lambda x: x.step_s)
        assert c["fits"] and "does not fit" not in c["text"]
        assert c["slower_pct"] == pytest.approx(100 * (e.step_s / res.best["step_time_s"] - 1), abs=0.01)
        assert c["slower_pct"] >= -100 * HEADROOM_TIE or not e.safe
    else:
        assert "does not fit" in c["text"]


def test_step_one_says_loudly_when_measured_memory_is_over_the_margin():
    from rayspeed.planner.feedback import memory_check

    res, _, _ = _plan("llama-70b@64")
    pred, margin = res.best["memory_gib_per_gpu"], res.best["memory_margin_gib"]
    over, line = memory_check(res.best, pred + margin + 0.5)
    assert over and line.startswith("MEMORY:") and f"{pred:.1f} GiB +- {margin:.1f}" in line
    over, line = memory_check(res.best, pred + 0.5 * margin)
    assert not over and "within the plan's" in line
