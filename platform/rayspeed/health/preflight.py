"""Preflight: a short health check on the job's own workers, before step 0.

    report = run_preflight(cfg, groups, device)     # on every rank of an initialized world; raises PreflightError

It lints each rank's environment, measures each rank alone (matmul, memory copy) and its link to the next rank,
runs a small all-reduce sweep over the world (and one size over the tp and dp groups when they are proper
subgroups, as training uses them), then decides on data every rank has gathered, so every rank reaches the same
verdict: all ranks raise the same PreflightError, or none does. Under a second on 2 CPU workers.

Fails on: an environment lint error on any rank, a collective returning wrong data (the world sweep, a parallel
group, or any node's intra-node or cross-node all-reduce of the per-node table), all-reduce bus bandwidth below
health.preflight_min_busbw_gbps, and (health.fail_on_slow_rank) a slow rank or node.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rayspeed.config.env_lint import relevant_env
from rayspeed.health import analysis, collectives
from rayspeed.health.envprofile import lint_env
from rayspeed.health.knowledge import Finding

log = logging.getLogger("rayspeed.health")


class PreflightError(RuntimeError):
    """The preflight failed: `reason` says why (one line); `report` holds the measurements."""

    def __init__(self, reason: str, report: "PreflightReport | None" = None):
        super().__init__(f"preflight failed: {reason}")
        self.reason = reason
        self.report = report


@dataclass
class PreflightReport:
    ok: bool
    seconds: float
    world_size: int
    backend: str
    nodes: int
    allreduce: list[dict] = field(default_factory=list)
    groups: dict[str, float] = field(default_factory=dict)
    """Slowest busbw (GB/s) of one all-reduce over each proper subgroup (tp, dp, pp)."""
    per_node: list[dict] = field(default_factory=list)
    """When the ranks span nodes: each node's ranks, intra-node all-reduce busbw, link to the other nodes
    (analysis.per_node); empty on one node."""
    ranks: list[dict] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "seconds": round(self.seconds, 3), "world_size": self.world_size,
                "backend": self.backend, "nodes": self.nodes, "allreduce": self.allreduce, "groups": self.groups,
                "per_node": self.per_node, "ranks": self.ranks, "findings": [f.to_json() for f in self.findings],
                "reason": self.reason}

    def summary(self) -> str:
        top = max(self.allreduce, key=lambda r: r["bytes"]) if self.allreduce else None
        bw = (f"all-reduce busbw {top['busbw_gbps']:.3g} GB/s at {_human(top['bytes'])} over {self.world_size} ranks"
              if top else f"{self.world_size} rank(s), no collective")
        grp = "".join(f", {k} {v:.3g} GB/s" for k, v in self.groups.items())
        flagged = [f for f in self.findings if f.severity != "info"]
        notes = [f"{f.category}: {f.evidence[0] if f.evidence else f.cause}" for f in flagged[:4]]
        tail = "; " + "; ".join(notes) if notes else "; nothing flagged"
        verdict = "ok" if self.ok else f"FAILED ({self.reason})"
        return f"preflight {verdict} in {self.seconds:.2f} s: {bw}{grp}{tail}"


def _human(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:g} {unit}"
    return f"{n} B"


def _sizes(device: torch.device) -> list[int]:
    return [1 << 20, 16 << 20, 128 << 20] if device.type == "cuda" else [4 << 10, 64 << 10, 1 << 20, 4 << 20]


def _subgroups(groups, world: int) -> list[tuple[str, Any]]:
    """The parallel groups training communicates over, where they differ from the world (the world is measured
    anyway) and have more than one rank."""
    if groups is None:
        return []
    out = []
    for name, size_attr, grp_attr in (("tp", "tp_size", "tp_group"), ("dp", "dp", "dp_group"),
                                      ("pp", "pp", "pp_group")):
        size = getattr(groups, size_attr, 1)
        if 1 < size < world:
            out.append((name, getattr(groups, grp_attr)))
    return out


def _device_name(device: torch.device) -> str | None:
    if device.type == "cuda":
        try:
            return torch.cuda.get_device_name(device)
        except Exception:
            return None
    return None


def verdict(h, sweep: list[dict], groups_bw: dict[str, float], node_table: list[dict], findings: list[Finding],
            lint_errors: list[Finding]) -> str:
    """Why the preflight fails ("" when it passes), from data every rank holds: an environment lint error, a
    collective that returned wrong data (the world sweep, a tp/dp/pp group, or a node of the per-node table), a
    bus bandwidth below the floor, and (health.fail_on_slow_rank) a slow rank or node."""
    wrong = [f"node {r['node']}: " + ", ".join(analysis.WRONG_RESULT_METRICS[m] for m in r["wrong_result"])
             for r in node_table if r.get("wrong_result")]
    if any(not r["ok"] for r in sweep):
        wrong.append("the all-reduce over the world")
    wrong += [f"{name} group all-reduce" for name, v in groups_bw.items() if v < 0]
    if lint_errors:
        return "environment: " + "; ".join(
            f"{f.extra.get('variable')}={f.extra.get('value')} (rank {','.join(map(str, f.extra['ranks']))}): "
            f"{f.cause} -> {f.remedy}" for f in lint_errors)
    if wrong:
        return f"a collective returned wrong data (faulty GPU, driver or transport): {'; '.join(wrong)}"
    if h.preflight_min_busbw_gbps and any(f.extra.get("floor_gbps") for f in findings):
        return next(f.cause for f in findings if f.extra.get("floor_gbps"))
    if h.fail_on_slow_rank and any(f.category == "slow_rank" for f in findings):
        return "slow: " + "; ".join(f.evidence[0] for f in findings if f.category == "slow_rank")
    return ""


def run_preflight(cfg, groups=None, device: Any = "cpu", sizes: list[int] | None = None) -> PreflightReport:
    """Run on every rank of an initialized torch.distributed world. `groups`: the job's ParallelGroups (or None).
    Returns the same report on every rank, or raises PreflightError on every rank."""
    t0 = time.perf_counter()
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    world, rank = dist.get_world_size(), dist.get_rank()
    h = cfg.health

    lint = lint_env(relevant_env(os.environ), production=h.production, world_size=world)
    bench = collectives.local_bench(dev, quick=True)
    link = (collectives.ring_sendrecv(None, (64 << 20) if dev.type == "cuda" else (1 << 20), dev, iters=2)
            if world > 1 else 0.0)
    sweep = (collectives.allreduce_sweep(None, sizes=sizes or _sizes(dev), device=dev, iters=3, warmup=1)
             if world > 1 else [])
    sub = {}
    for name, grp in _subgroups(groups, world):
        rows = collectives.allreduce_sweep(grp, sizes=[max(sizes or _sizes(dev))], device=dev, iters=2, warmup=1)
        sub[name] = rows[0]["busbw_gbps"] if rows[0]["ok"] else -1.0

    mine = {"rank": rank, "node": socket.gethostname(), "device": str(dev), **bench,
            "link_gbps": round(link, 4) if world > 1 else None, "groups": sub,
            "lint": [f.to_json() for f in lint if f.severity != "info"]}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)

    nodes = len({r["node"] for r in everyone})
    findings: list[Finding] = []
    node_table: list[dict] = []
    if nodes > 1:  # on one node the world all-reduce above is the intra-node figure
        measured = collectives.node_bandwidth([r["node"] for r in everyone], dev,
                                              (64 << 20) if dev.type == "cuda" else (1 << 20), iters=2)
        node_table, node_findings = analysis.per_node(measured, h.slow_rank_factor)
        findings += node_findings
    # Each variable once, with the ranks that have it.
    seen: dict[str, tuple[dict, list[int]]] = {}
    for r in everyone:
        for f in r["lint"]:
            key = f"{f['id']}={f.get('value')}"
            seen.setdefault(key, (f, []))[1].append(r["rank"])
    lint_errors = []
    for f, ranks in seen.values():
        extra = {k: v for k, v in f.items()
                 if k not in ("category", "cause", "remedy", "severity", "id", "source", "evidence")}
        finding = Finding(category=f["category"], cause=f["cause"], remedy=f["remedy"], severity=f["severity"],
                          id=f["id"], source=f["source"], evidence=f["evidence"], extra={**extra, "ranks": ranks})
        findings.append(finding)
        if finding.severity == "error":
            lint_errors.append(finding)

    groups_bw: dict[str, float] = {}
    for r in everyone:
        for name, bw in r["groups"].items():
            groups_bw[name] = min(groups_bw.get(name, bw), bw)
    ranks = [{k: v for k, v in r.items() if k not in ("lint", "groups")} for r in everyone]
    findings += analysis.rank_findings(ranks, h.slow_rank_factor)
    hw = analysis.hardware_for(_device_name(dev), cfg.cluster.gpu, cfg.cluster.use_gpu,
                               getattr(cfg.cluster, "hardware", None))
    findings += analysis.device_findings(ranks, hw)
    findings += analysis.bandwidth_findings(sweep, hw, nodes, min_busbw=h.preflight_min_busbw_gbps)

    reason = verdict(h, sweep, groups_bw, node_table, findings, lint_errors)
    report = PreflightReport(ok=not reason, seconds=time.perf_counter() - t0, world_size=world,
                             backend=dist.get_backend(), nodes=nodes, allreduce=sweep, groups=groups_bw,
                             per_node=node_table, ranks=ranks, findings=findings, reason=reason)
    if rank == 0:
        (log.error if reason else log.info)("%s", report.summary())
        for line in analysis.per_node_lines(node_table):
            log.info("preflight %s", line)
    if reason:
        raise PreflightError(reason, report)
    return report
