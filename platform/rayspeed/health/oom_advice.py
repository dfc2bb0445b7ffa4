"""A CUDA OOM explained with the numbers in the message and the planner's view of the job, for `rayspeed doctor`.

PyTorch's message says how much was asked for, the capacity, and how much is reserved but unallocated: that
tells fragmentation (set the allocator) from a layout that does not fit (change it). When the log names the job
file (`--config FILE` on the command line it shows) or one is given, the planner says what the failed layout
needed and which layout would fit.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rayspeed.config.layout import LAYOUT_KEYS, Layout, LayoutError
from rayspeed.errors import ConfigError
from rayspeed.health.knowledge import Finding
from rayspeed.health.log_detectors import FLOAT

_CONFIG_IN_LOG = re.compile(r"--config[= ]+(\S+\.ya?ml)\b")
_SET_IN_LOG = re.compile(r"--set[= ]+(\S+=\S+)")
# cp and ep: logs of rayspeed since they were printed (an older log's plan line has neither: 1).
_PLAN_IN_LOG = re.compile(r"plan: dp=(?P<dp>\d+)(?: cp=(?P<cp>\d+))? tp=(?P<tp>\d+) pp=(?P<pp>\d+)(?: ep=(?P<ep>\d+))? "
                          r"zero=(?P<zero>\d+) micro=(?P<micro>\d+) accum=(?P<accum>\d+) ac=(?P<ac>\w+)")
_STEP = re.compile(r"\bstep[ =:]+(\d+)\b", re.IGNORECASE)
_GIB = re.compile(rf"({FLOAT})\s*(GiB|MiB|KiB|GB|MB)")


def _gib(text: str) -> float | None:
    m = _GIB.search(text)
    if not m:
        return None
    v = float(m.group(1))
    return v * {"GiB": 1, "GB": 1, "MiB": 1 / 1024, "MB": 1 / 1024, "KiB": 1 / 1024**2}[m.group(2)]


def oom_details(lines: list[str], first: int) -> dict[str, Any]:
    """The numbers of PyTorch's OOM message at line index `first`, and the last step the log reached before it."""
    d: dict[str, Any] = {}
    window = " ".join(lines[first:first + 6])
    m = re.search(rf"Tried to allocate ({FLOAT}\s*(?:GiB|MiB|KiB|GB|MB))", window)
    if m:
        d["tried_gib"] = _gib(m.group(1))
    m = re.search(rf"total capacity of ({FLOAT}\s*(?:GiB|MiB|GB|MB))", window)
    if m:
        d["capacity_gib"] = _gib(m.group(1))
    m = re.search(rf"({FLOAT}\s*(?:GiB|MiB|GB|MB)) is allocated by PyTorch", window)
    if m:
        d["allocated_gib"] = _gib(m.group(1))
    m = re.search(rf"({FLOAT}\s*(?:GiB|MiB|GB|MB)) is reserved by PyTorch but unallocated", window)
    if m:
        d["reserved_unallocated_gib"] = _gib(m.group(1))
    steps = [int(m.group(1)) for line in lines[:first] for m in _STEP.finditer(line)]
    # "start: ... to the first step (...)" (and the older "first step done"): step 1 had finished
    if not steps and any("first step done" in line or "to the first step (" in line for line in lines[:first]):
        steps = [1]
    d["last_step_before"] = steps[-1] if steps else None
    return d


def planner_view(cfg, lines: list[str]) -> dict[str, Any]:
    """What the planner says about the job: the layout the log ran (if it says), and the best fitting one."""
    from rayspeed.planner import evaluate_layout, plan_job

    view: dict[str, Any] = {}
    m = None
    for line in lines:
        m = _PLAN_IN_LOG.search(line) or m
    world = None
    if m:
        try:
            g = m.groupdict()
            ran_layout = Layout(*(int(g[k]) for k in ("dp", "tp", "pp", "zero", "micro", "accum")),
                                activation_checkpointing=g["ac"], cp=int(g["cp"] or 1), ep=int(g["ep"] or 1))
        except LayoutError:  # the log's plan line is not a layout rayspeed could have run
            ran_layout = None
        if ran_layout is not None:
            lay = {k: v for k, v in ran_layout.as_dict().items() if k != "sequence_parallel"}
            world = ran_layout.world_size
            ran = evaluate_layout(cfg, lay, world_size=world)
            view["ran"] = {**lay, "memory_gib_per_gpu": ran.get("memory_gib_per_gpu"), "fits": ran.get("fits"),
                           "usable_memory_gib": ran.get("usable_memory_gib"), "reason": ran.get("reason")}
    try:
        best = plan_job(cfg, world_size=world).best
        keys = [k for k in LAYOUT_KEYS if k != "sequence_parallel"]
        view["best"] = {k: best.get(k) for k in (*keys, "memory_gib_per_gpu", "fits")}
    except ConfigError as e:
        view["best"] = None
        view["no_fit"] = e.render()
    return view


def _planner_notes(view: dict[str, Any]) -> list[str]:
    notes = []
    ran, best = view.get("ran"), view.get("best")
    if ran and ran.get("memory_gib_per_gpu") is not None:
        notes.append(f"the planner predicts the layout in the log (dp{ran['dp']} tp{ran['tp']} pp{ran['pp']} "
                     f"zero{ran['zero_stage']} mb{ran['micro_batch_size']} ga{ran['grad_accum']} "
                     f"ckpt={ran['activation_checkpointing']}) needs {ran['memory_gib_per_gpu']:.1f} GiB per GPU of "
                     f"{ran.get('usable_memory_gib') or 0:.1f} usable")
    if best:
        changes = [f"parallel.{k}={best[k]}" for k in ("zero_stage", "micro_batch_size", "grad_accum",
                                                      "activation_checkpointing", "tp", "pp")
                   if not ran or ran.get(k) != best[k]]
        notes.append(f"the planner's best fitting layout needs {best['memory_gib_per_gpu']:.1f} GiB per GPU: "
                     + (", ".join(changes) if changes else "the same layout (so suspect fragmentation or "
                        "memory outside the model: another process on the GPU)")
                     + " (or leave parallel.* auto)")
    elif view.get("no_fit"):
        notes.append("the planner finds no layout that fits this job on this cluster: " + view["no_fit"])
    return notes


def explain_oom(f: Finding, lines: list[str], cfg) -> None:
    """Rewrite a CUDA OOM finding's cause and remedy for this job: fragmentation or not, and what would fit."""
    d = oom_details(lines, f.extra.get("first_line", 1) - 1)
    f.extra["oom"] = d
    notes = []
    unalloc, cap = d.get("reserved_unallocated_gib"), d.get("capacity_gib")
    frag = unalloc is not None and (unalloc >= 0.05 * (cap or 0) or unalloc >= (d.get("tried_gib") or 0) > 0)
    if frag:
        f.cause = (f"fragmentation: {unalloc:.2f} GiB is reserved by PyTorch but unallocated (the allocation of "
                   f"{d.get('tried_gib') or 0:.2f} GiB could not be placed in it). " + f.cause)
        f.remedy = ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (or garbage_collection_threshold:0.9) in "
                    "cluster.env; then, if it still runs out, change the layout. " + f.remedy)
    elif unalloc is not None:
        f.cause = (f"not fragmentation (only {unalloc:.2f} GiB reserved but unallocated"
                   + (f" of {cap:.1f} GiB" if cap else "") + "): the layout needs more memory than the GPU has. "
                   + f.cause)
    if d.get("last_step_before") is not None and d["last_step_before"] <= 2:
        notes.append(f"it failed right after step {d['last_step_before']}: the optimizer state is allocated by the "
                     "first step, so the layout needs the memory of a full step, not just of the forward pass")
    if cfg is not None:
        try:
            view = planner_view(cfg, lines)
        except Exception as e:  # the diagnosis must not fail because the job file no longer plans
            view = {"error": str(e)[:300]}
        f.extra["planner"] = view
        notes += _planner_notes(view)
    if notes:
        f.remedy = f.remedy + " For this job: " + "; ".join(notes) + "."


def config_from_log(lines: list[str], base: Path | None) -> Any:
    """The job file named on the command line the log shows, with that line's --set overrides except the
    parallel.* ones: the planner is asked what it would choose, not what the failed run was forced into."""
    from rayspeed.config.load import load as load_job

    for line in lines:
        m = _CONFIG_IN_LOG.search(line)
        if not m:
            continue
        sets = [s for s in _SET_IN_LOG.findall(line) if not s.startswith("parallel.")]
        # As written (absolute, or relative to here), else relative to the log's folder or any folder above it
        # (a log saved inside the repository that ran the job).
        roots = [Path.cwd()] + ([base, *base.parents] if base else [])
        for cand in [Path(m.group(1))] + [r / m.group(1) for r in roots]:
            if cand.is_file():
                try:
                    return load_job(str(cand), sets)
                except ConfigError:
                    return None
    return None
