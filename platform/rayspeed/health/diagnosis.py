"""`diagnose(text)`: a log in, Findings out, the one that explains the failure first.

Every signature, cause, remedy and source comes from knowledge.yaml; this module matches the signatures line by
line, adds the detectors' findings (log_detectors), keeps one finding per environment variable, explains an OOM
with the planner (oom_advice), and ranks the result (ranking).
"""

from __future__ import annotations

import re
from pathlib import Path

from rayspeed.health.knowledge import Finding, Knowledge, load
from rayspeed.health.log_detectors import MAX_EVIDENCE, detector_findings, evidence_line
from rayspeed.health.oom_advice import config_from_log, explain_oom
from rayspeed.health.ranking import rank_findings

# TORCH_NCCL_DESYNC_DEBUG's report (c10d TraceUtils.h, retrieveDesyncReport): the ranks that never joined, or
# that joined and did not finish. They are the ones to look at; every other rank only waited for them.
_LAGGING = re.compile(r"ranks \[([\d, ]+)\] are the lagging ranks|- \[([\d, ]+)\] joined but didn't finish|"
                      r"\[([\d, ]+)\] finished collective #\d+, but didn't join")


# A log record at INFO or DEBUG level (Python logging, Ray, MLflow, glog): it may quote an error ("retrying after
# CUDA out of memory" in a message, a config dump) but it does not report one. Error signatures skip such lines.
_INFO_LINE = re.compile(r"(?:^|[\s\[|:])(?:INFO|DEBUG)(?:[\s\]|:]|$)|^[ID]\d{4} \d")


def is_info_line(line: str) -> bool:
    return bool(_INFO_LINE.search(line[:160]))


def signature_findings(lines: list[str], kb: Knowledge) -> list[Finding]:
    out = []
    for e in kb.entries:
        if not e.signature:
            continue
        hits = [i for i, line in enumerate(lines) if any(rx.search(line) for rx in e.signature)
                and not (e.severity == "error" and is_info_line(line))]
        if hits:
            out.append(e.finding(evidence=[evidence_line(lines, i) for i in hits[:MAX_EVIDENCE]], count=len(hits),
                                 first_line=hits[0] + 1))
    return out


def _one_per_variable(found: list[Finding]) -> list[Finding]:
    """The env lint and PyTorch's own deprecation warning may both name a variable: keep the first."""
    seen_vars = set()
    unique = []
    for f in found:
        var = f.extra.get("variable")
        if f.id == "deprecated_env_warning":
            m = re.search(r"Environment variable (\w+) is deprecated; use (\w+)", " ".join(f.evidence))
            if m:
                var = m.group(1)
                f.extra.update(variable=var, use=m.group(2))
                f.remedy = f"use {m.group(2)} instead of {var}"
        if var:
            if var in seen_vars:
                continue
            seen_vars.add(var)
        unique.append(f)
    return unique


def _lagging_ranks(f: Finding, lines: list[str]) -> None:
    ranks: list[int] = []
    for line in lines:
        for m in _LAGGING.finditer(line):
            group = next(g for g in m.groups() if g)
            ranks += [int(r) for r in group.split(",") if r.strip()]
    if ranks:
        ranks = sorted(set(ranks))
        f.extra["lagging_ranks"] = ranks
        f.cause = (f"PyTorch's desync report names rank(s) {', '.join(map(str, ranks))} as the one(s) that did not "
                   "join or finish the collective; the others only waited for them. " + f.cause)


def diagnose(text: str, cfg=None, production: bool = True, log_dir: Path | None = None) -> list[Finding]:
    """Findings for a log, the one that explains the failure first (see ranking)."""
    kb = load()
    lines = text.splitlines()
    found = _one_per_variable(detector_findings(lines, kb, production) + signature_findings(lines, kb))
    # NCCL INFO lines alone are a choice someone made to look at NCCL, not a failure: the hint to turn them off
    # in production accompanies a diagnosis, it is not one.
    if all(f.id == "nccl_debug_info_in_production" for f in found):
        found = []
    # A blow-up covers the same norms the spike test and the NaN signature saw: a warning beside the error
    # would only repeat it.
    if any(f.id == "grad_norm_blowup" for f in found):
        found = [f for f in found if f.id != "grad_norm_spike"]
    if any(f.id == "cuda_oom" for f in found):
        cfg = cfg if cfg is not None else config_from_log(lines, log_dir)
        for f in found:
            if f.id == "cuda_oom":
                explain_oom(f, lines, cfg)
    for f in found:
        if f.id == "nccl_watchdog_timeout":
            _lagging_ranks(f, lines)
    return rank_findings(found)
