"""The order of `rayspeed doctor`'s findings: what explains the failure first.

A failed job's log holds a chain: one cause (a rank ran out of memory, an InfiniBand link failed, /dev/shm was
full), the deaths it caused (the rank's actor died), and their consequences on everyone else (the survivors'
collectives time out, the job hangs). Around it sit hints about the environment (NCCL_DEBUG=INFO, a deprecated
variable) that explain nothing about this failure. So findings are ranked by tier first, then severity, then
where they first appear (the earliest cause of a tier started the chain):

    0 cause         oom, shm_exhausted, checkpoint_missing/corrupt, nan_loss, grad_explosion, worker_died,
                    a transport error of the network (IB completion error, socket failure)
    1 consequence   nccl_timeout, hang, rank_failed, a peer or system error NCCL reports without the why
    2 performance   slow_throughput, slow_rank, topology, bandwidth, a fallback to TCP sockets
    3 environment   env_invalid
    4 note          anything at info severity

A worker's death that a cause explains (the OOM that killed it, the watchdog that took its own process down
after a timeout) is not a second root cause: it is folded into the finding that explains it (`led_to`).
"""

from __future__ import annotations

from rayspeed.health.knowledge import Finding

CAUSE, CONSEQUENCE, PERFORMANCE, ENVIRONMENT, NOTE = range(5)
TIER_NAMES = ("cause", "consequence", "performance", "environment", "note")

CATEGORY_TIERS = {
    "oom": CAUSE, "shm_exhausted": CAUSE, "checkpoint_missing": CAUSE, "checkpoint_corrupt": CAUSE,
    "nan_loss": CAUSE, "grad_explosion": CAUSE, "worker_died": CAUSE, "network": CAUSE,
    "nccl_timeout": CONSEQUENCE, "hang": CONSEQUENCE, "rank_failed": CONSEQUENCE,
    "slow_throughput": PERFORMANCE, "slow_rank": PERFORMANCE, "topology": PERFORMANCE, "bandwidth": PERFORMANCE,
    "env_invalid": ENVIRONMENT,
}
# Entries whose category names where the trouble is, but whose message does not say why (NCCL's "remote
# process exited or there was a network error" is what every survivor reports when a peer dies), and a fallback
# to TCP sockets, which slows a job down without failing it.
_TIER_BY_ID = {"nccl_remote_error": CONSEQUENCE, "nccl_system_error": CONSEQUENCE,
               "nccl_socket_fallback": PERFORMANCE}
_SEVERITY = {"error": 0, "warn": 1, "info": 2}
# How far after a death's first line its own message can still explain it: Ray prints the exception header
# ("The actor died unexpectedly ...") before the detail ("... killed due to the node running low on memory").
_DETAIL_LINES = 30


def tier(f: Finding) -> int:
    if f.severity == "info":
        return NOTE
    return _TIER_BY_ID.get(f.id, CATEGORY_TIERS.get(f.category, CONSEQUENCE))


def _line(f: Finding) -> int:
    return f.extra.get("first_line", 0)


def _explainer(death: Finding, findings: list[Finding]) -> Finding | None:
    """The finding that explains a worker's death: a cause or consequence at error severity seen before it (the
    watchdog takes its own process down after a timeout), or a cause in the detail of the death's own message
    (Ray's OOM wording, the node's death)."""
    best = None
    for f in findings:
        if f is death or f.severity != "error" or tier(f) > CONSEQUENCE:
            continue
        # Another death explains this one only when it is its node's: every actor on a dead node dies with it.
        if f.category == "worker_died" and not (f.id == "node_died" and death.id != "node_died"):
            continue
        before = _line(f) <= _line(death)
        # Only what Ray itself names as the reason in the death's message: a network error right after a death is
        # what the survivors see when their peer's queue pairs vanish, a consequence and not the reason.
        names_reason = f.category == "oom" or f.id == "node_died"
        in_detail = names_reason and _line(death) < _line(f) <= _line(death) + _DETAIL_LINES
        if (before or in_detail) and (best is None or _key(f) < _key(best)):
            best = f
    return best


def _key(f: Finding) -> tuple:
    return tier(f), _SEVERITY.get(f.severity, 3), _line(f)


def rank_findings(findings: list[Finding]) -> list[Finding]:
    """The findings most explanatory first; explained deaths folded into their explanation; consequences that
    follow a cause marked with it (`follows`)."""
    kept = []
    for f in findings:
        if f.category == "worker_died":
            why = _explainer(f, findings)
            if why is not None:
                why.extra.setdefault("led_to", []).extend(f.evidence)
                continue
        kept.append(f)
    kept.sort(key=_key)
    causes = [f for f in kept if tier(f) == CAUSE and f.severity == "error"]
    for f in kept:
        if tier(f) == CONSEQUENCE and f.severity == "error":
            before = [c for c in causes if _line(c) <= _line(f)]
            if before:
                c = min(before, key=_key)
                f.extra["follows"] = f"{c.category} (line {_line(c)})"
    return kept
