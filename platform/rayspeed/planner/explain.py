"""The human-readable answer: chosen layout, one line per decision, memory table, time split, runner-ups and
why they lost, the field guide's rules."""

from __future__ import annotations

from rayspeed.planner.hardware import GIB
from rayspeed.planner.inputs import Ctx
from rayspeed.planner.memory import COMPONENTS
from rayspeed.planner.pick_order import HEADROOM_TIE, NEAR_TIE, headroom, model_error, spare_gib
from rayspeed.planner.search import Estimate
from rayspeed.planner.timing import OVERLAP_TAX

TIME_PARTS = (
    ("compute_s", "compute (forward + backward + recomputation)"),
    ("tp_comm_s", "tensor-parallel collectives"),
    ("pp_bubble_s", "pipeline bubble"),
    ("pp_p2p_s", "pipeline sends"),
    ("dp_comm_s", "exposed data-parallel/ZeRO communication"),
    ("zero3_overhead_s", "ZeRO-3 gather bookkeeping"),
    ("optimizer_s", "optimizer step + engine"),
    ("straggler_s", "waiting for the slowest GPU"),
)
LABEL = dict(TIME_PARTS)


def why_lost(e: Estimate, best: Estimate) -> str:
    """The time component that grew the most against the chosen layout."""
    a, b = e.time.as_dict(), best.time.as_dict()
    diffs = {k: a[k] - b[k] for k, _ in TIME_PARTS}
    k = max(diffs, key=diffs.__getitem__)
    slower = 100 * (e.step_s / best.step_s - 1)
    if slower < -0.05:
        if best.safe and not e.safe:
            return (f"{-slower:.1f}% faster by the model, but {e.memory_text()} leaves less than its memory margin "
                    f"(the chosen: {best.memory_text()})")
        if best.safe:
            return (f"{-slower:.1f}% faster by the model, within {100 * HEADROOM_TIE:.0f}%: the chosen layout leaves "
                    f"more memory to spare ({spare_gib(best):.2f} GiB against {spare_gib(e):.2f})")
        return f"{-slower:.1f}% faster by the model, within {100 * NEAR_TIE:.0f}%: the chosen layout is simpler"
    if slower <= 0.05:
        return ("a near tie: the chosen layout is simpler (less accumulation, smaller tp/pp, lower ZeRO, "
                "less recomputation)")
    what = LABEL[k]
    if k == "compute_s" and a["recompute_s"] - b["recompute_s"] > 0.5 * diffs[k]:
        what = "recomputation"
    return f"{slower:.1f}% slower: more {what} (+{diffs[k]:.3g} s)"


def _gib(v: float) -> str:
    return f"{v:9.2f}" if v >= 0.1 or v == 0 else f"{v:9.4f}"


def memory_table(e: Estimate) -> list[str]:
    who = "GPU" if e.ctx.hw.is_gpu else "worker"
    lines = [f"memory per {who}, worst rank (pipeline stage {e.worst_stage}), GiB:"]
    for k in (*COMPONENTS, *(k for k in e.memory if k not in COMPONENTS)):  # then features' terms
        v = e.memory.get(k, 0.0) / GIB
        if v > 0:
            lines.append(f"  {k:<18} {_gib(v)}")
    lines.append(f"  {'total':<18} {_gib(e.memory_gib)}   +- {e.margin_gib:.2f} (the memory model's margin) of "
                 f"{e.ctx.usable_gib:.2f} usable ({e.ctx.memory_gib:.1f} x {e.ctx.usable_fraction:.2f})")
    return lines


def time_table(e: Estimate) -> list[str]:
    t = e.time.as_dict()
    who = "GPU" if e.ctx.hw.is_gpu else "worker"
    basis = f"calibrated profile {e.ctx.profile}" if e.ctx.profile else "uncalibrated"
    lines = [f"time per step (predicted, {basis}): {e.step_s:.4f} s -> {e.tokens_per_s_per_gpu:,.0f} tokens/s per "
             f"{who}, MFU {100 * e.mfu:.1f}% (6N + 12 L h s per token: attention counted in full, not halved for "
             "the causal mask)"]
    parts = [*TIME_PARTS, *((k, k) for k in e.time.terms)]  # then features' terms (planner/terms.py)
    for k, label in parts:
        if t[k] > 0:
            lines.append(f"  {label:<45} {t[k]:9.4f} s  {100 * t[k] / e.step_s:5.1f}%")
    if t["recompute_s"] > 0:
        lines.append(f"    of which recomputation {t['recompute_s']:.4f} s")
    if t["dp_comm_total_s"] > t["dp_comm_s"]:
        lines.append(f"    data-parallel communication in all {t['dp_comm_total_s']:.4f} s; overlapping it with "
                     f"compute saves {t['dp_comm_total_s'] - t['dp_comm_s']:.4f} s (the compute beside a collective "
                     f"is charged {100 * OVERLAP_TAX:.0f}% more)")
    return lines


def adapter_lines(e: Estimate) -> list[str]:
    """An adapter job: what trains, its share of the memory, and the same layout as a full fine-tune."""
    ap = e.ctx.adapter
    if ap is None:
        return []
    import dataclasses

    from rayspeed.planner.memory import worst_stage
    from rayspeed.planner.timing import step_time

    full_ctx = dataclasses.replace(e.ctx, adapter=None)
    full_mem = sum(worst_stage(full_ctx, e.layout)[1].values()) / GIB
    full_s = step_time(full_ctx, e.layout).step_s
    trains = sum(e.memory.get(k, 0.0) for k in ("gradients", "master_weights", "optimizer_states")) / GIB
    kind = ("Q" if ap.nf4 else "") + ("DoRA" if ap.dora else "LoRA")
    base = ("frozen in NF4 (4-bit linear weights, "
            f"{e.memory.get('weights', 0.0) / GIB:.2f} GiB of weights per rank)" if ap.nf4 else "frozen")
    own = ", ".join(f"{r} {ap.rank_of(r)}" for r in ap.roles if ap.rank_of(r) != ap.rank)
    return ["", f"adapters: {kind} rank {ap.rank}{f' ({own})' if own else ''} on {','.join(ap.roles)}"
            + (f", {'+'.join(ap.full)} in full" if ap.full else "") + f"; the base is {base}",
            f"  memory: the frozen base's weights and the adapters' {trains:.2f} GiB of gradients, master weights and "
            f"optimizer state per rank; as a full fine-tune this layout needs {full_mem:.1f} GiB"
            + (" (does not fit)" if full_mem > e.ctx.usable_gib else ""),
            f"  time: {e.step_s:.4f} s per step, {100 * (1 - e.step_s / full_s):.0f}% less than the full fine-tune's "
            f"{full_s:.4f} s at this layout (no weight gradients for frozen layers; the adapters' thin GEMMs)"]


def render(ctx: Ctx, best: Estimate, alternatives: list[Estimate], estimates: list[Estimate], rules: dict,
           fixed: dict, notes: list[str], job_name: str, counts: dict, claims: list[dict]) -> str:
    sh = ctx.shape
    err = model_error(ctx)
    lay = best.layout
    L = []
    n = sh.params
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    L.append(f"rayspeed plan: {job_name}: {size} parameters ({sh.num_layers} layers, hidden {sh.hidden_size}, "
             f"{sh.num_heads} heads / {sh.num_kv_heads} kv, ffn {sh.ffn_hidden_size}, vocab {sh.vocab_size}, "
             f"seq {sh.seq_len}, {'tied' if sh.tie_embeddings else 'untied'} embeddings)")
    L.append(f"cluster: {ctx.world} x {ctx.hw.name} ({ctx.nodes} node(s) x {ctx.node_size}), {ctx.precision}; "
             + (f"global batch {ctx.global_batch} sequences = {ctx.global_batch * sh.seq_len:,} tokens per step"
                if ctx.rows_per_sample == 1 else
                f"global batch {ctx.global_batch} preference pairs = {ctx.global_batch * ctx.rows_per_sample} "
                f"sequences = {ctx.global_batch * ctx.rows_per_sample * sh.seq_len:,} tokens per step"))
    L.append("hardware: "
             + (ctx.profile and f"calibrated profile {ctx.profile} (held-out error "
                                f"{'%.1f%%' % (100 * ctx.model_error) if ctx.model_error else 'not fitted'})"
                or "built-in table (no profile: `rayspeed calibrate --out FILE`, then --profile FILE)"))
    L.append("")
    chosen = next(c for c in claims if c["kind"] == "chosen")
    L.append(f"chosen layout: {lay.short()}: {chosen['text']}")
    excluded = (f"; {counts['excluded_by_cap']} excluded by the accumulation cap, with their numbers below"
                if counts["excluded_by_cap"] else "")
    L.append(f"  {counts['evaluated']} layouts evaluated, {counts['fitting']} fit in memory"
             f"{excluded}; {best.memory_text()} of {ctx.usable_gib:.1f} GiB usable")
    for c in claims:
        if c["kind"] == "key":
            L.append(f"  - {c['text']}")
    L.append("")
    L += memory_table(best)
    L.append("")
    L += time_table(best)
    L += adapter_lines(best)
    L.append("")
    faster = [c for c in claims if c["kind"] == "faster_not_chosen"]
    if faster:
        L.append(f"faster layouts not chosen ({len(faster)}{'+' if len(faster) >= 50 else ''}):")
        for c in faster[:8]:
            L.append(f"  - {c['text']}")
        L.append("")
    fastest = min((x.step_s for x in estimates if x.fits), default=best.step_s)
    ties = [e for e in estimates if e.fits and e.safe and e.step_s <= fastest * (1 + err)]
    if len(ties) > 1:
        L.append(f"near tie: {len(ties)} layouts that fit with the margin are within the time model's own error "
                 f"(+-{100 * err:.0f}%{', held out on ' + ctx.profile if ctx.profile else ', uncalibrated'}) of the "
                 f"fastest ({100 * headroom(best):.0f}% of usable memory free on the chosen one); measure a few steps "
                 "of the runner-ups to decide between them")
        L.append("")
    if alternatives:
        L.append("runner-up layouts:")
        for i, e in enumerate(alternatives, 1):
            L.append(f"  {i}. {e.layout.short()}: {e.step_s:.4f} s, {e.memory_gib:.1f} GiB; {why_lost(e, best)}")
    # Faster layouts that miss by little (within half the usable memory): what more memory would buy.
    near = [e for e in estimates if not e.fits and e.overshoot_gib() < 0.5 * ctx.usable_gib and e.step_s < best.step_s]
    misses = sorted(near, key=lambda e: e.step_s)[:3]
    if misses:
        L.append("faster layouts that just do not fit:")
        for e in misses:
            k, v = e.biggest_part()
            L.append(f"  - {e.layout.short()}: {e.step_s:.4f} s but {e.memory_gib:.1f} GiB "
                     f"(over by {e.overshoot_gib():.1f}; largest part {k} {v:.1f} GiB)")
    L.append("")
    L.append("field guide rules:")
    s = rules["strategy"]
    L.append(f"  strategy by size ({size}, {s['gpus']} {'GPUs' if ctx.hw.is_gpu else 'workers'}): {s['recommends']}; "
             f"{s['note']}")
    lr = rules["lr"]
    used = ("used for train.lr: auto" if lr.get("applied")
            else "not used: train.lr is a number (its default or the job's); train.lr: auto applies the rule")
    L.append(f"  learning rate: {lr['rule']} = {lr['lr']:.3g} ({used})"
             + (f"; {lr['floored']}" if "floored" in lr else ""))
    if lr.get("applied") and "warning" in lr:
        L.append(f"    WARNING: {lr['warning']}")
    cap = rules["accumulation_cap"]
    moot = cap["why"].startswith("excludes nothing")  # a cap no layout reaches says nothing as a number
    L.append(f"  accumulation cap: {cap['statement']}" + ("" if moot else f" = {cap['max_grad_accum']}")
             + f": {cap['why']}")
    c = rules["comm_profile"]
    L.append(f"  communication: {c['tier']}; env {c['env'] or '{}'}; deepspeed {c['deepspeed'] or '{}'}")
    for n in c["notes"]:
        L.append(f"    - {n}")
    p = rules["precision"]
    L.append(f"  precision: {p['precision']} ({p['why']}); TF32 for fp32 matmuls: {p['tf32']}"
             + (f"; {p['warning']}" if "warning" in p else ""))
    for c in claims:
        if c["kind"] == "hpz":
            L.append(f"  {c['text']}")
    ck = rules["checkpointing"]
    L.append(f"  activation checkpointing: {ck['template']} (mode {ck['mode']}); not applied: {ck['not_applied']}")
    t = rules["topology"]
    L.append(f"  topology: {t['nodes']} node(s) x {t['ranks_per_node']}; tp within a node: {t['tp_within_node']}; "
             f"symmetric: {t['symmetric']}; >= 4 per node: {t['min_4_per_node']}; {t['order']}")
    if notes:
        L.append("")
        L.append("assumptions:")
        for note in notes:
            L.append(f"  - {note}")
    return "\n".join(L) + "\n"
