"""Measurements -> Findings: slow ranks and nodes against the rest, bus bandwidth against the hardware table.

Pure functions over plain dicts, shared by the healthcheck (Ray) and the preflight (inside the job).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any, Hashable, Mapping

from rayspeed.health.knowledge import Finding, load

# What each per-rank measurement is called in findings.
RANK_METRICS = {"matmul_gflops": "matmul GFLOP/s", "copy_gbps": "memory copy GB/s",
                "link_gbps": "link to next rank GB/s"}


def outliers(values: Mapping[Hashable, float], factor: float) -> list[tuple[Hashable, float, float]]:
    """(key, value, median of the others) for each value below factor x the median of the others.

    Compared with the others, not with a median that includes itself: with two ranks, one slow rank would
    otherwise drag the reference down with it.
    """
    out = []
    items = [(k, float(v)) for k, v in values.items() if v is not None]
    for k, v in items:
        others = [w for k2, w in items if k2 != k]
        if not others:
            continue
        med = statistics.median(others)
        if med > 0 and v < factor * med:
            out.append((k, v, med))
    return out


def rank_findings(ranks: list[dict[str, Any]], factor: float) -> list[Finding]:
    """Slow ranks per metric, and slow nodes (a node whose ranks' median falls below the other nodes')."""
    kb = load()
    found: list[Finding] = []
    for metric, label in RANK_METRICS.items():
        vals = {r["rank"]: r[metric] for r in ranks if r.get(metric)}
        if len(vals) < 2:
            continue
        node_of = {r["rank"]: r.get("node", "") for r in ranks}
        for rank, v, med in outliers(vals, factor):
            found.append(kb.entry("slow_rank").finding(
                evidence=[f"rank {rank} ({node_of.get(rank, '')}): {label} {v:.3g} vs median of the others {med:.3g}"],
                rank=rank, node=node_of.get(rank, ""), metric=metric, value=v, median_others=med))
        per_node: dict[str, list[float]] = defaultdict(list)
        for r in ranks:
            if r.get(metric):
                per_node[r.get("node", "")].append(float(r[metric]))
        if len(per_node) >= 2:
            med_by_node = {n: statistics.median(v) for n, v in per_node.items()}
            for node, v, med in outliers(med_by_node, factor):
                found.append(kb.entry("slow_node").finding(
                    evidence=[f"node {node}: median {label} {v:.3g} vs the other nodes' {med:.3g}"],
                    node=node, metric=metric, value=v, median_others=med))
    return found


def device_findings(ranks: list[dict[str, Any]], hw, fraction: float = 0.5) -> list[Finding]:
    """GPU ranks against the hardware table (a node whose GPUs are all throttled looks fine against the rest):
    bf16 matmul against the achievable GEMM rate, the copy against HBM bandwidth. CPU entries are rough planning
    numbers, so CPU ranks are not judged this way."""
    if not hw.is_gpu:
        return []
    kb = load()
    out = []
    refs = {"matmul_gflops": hw.peak("bf16") * hw.gemm_efficiency / 1e9, "copy_gbps": hw.hbm_gbps}
    for r in ranks:
        for metric, ref in refs.items():
            v = r.get(metric)
            if v and ref and v < fraction * ref:
                out.append(kb.entry("slow_rank").finding(
                    evidence=[f"rank {r['rank']} ({r.get('node', '')}): {RANK_METRICS[metric]} {v:.4g}, "
                              f"the hardware table ({hw.name}) expects about {ref:.4g}"],
                    rank=r["rank"], node=r.get("node", ""), metric=metric, value=v, expected=ref))
    return out


def expected_busbw(hw, nodes: int) -> float:
    """The bandwidth that bounds a collective over this placement: the network per GPU once it spans nodes."""
    return hw.inter_node_gbps if nodes > 1 else hw.intra_node_gbps


def bandwidth_findings(rows: list[dict[str, Any]], hw, nodes: int, op: str = "allreduce",
                       fraction: float = 0.5, min_busbw: float = 0.0) -> list[Finding]:
    """Wrong results, and bus bandwidth at the largest message against the hardware table (and a floor)."""
    kb = load()
    out: list[Finding] = []
    if not rows:
        return out
    bad = [r for r in rows if not r.get("ok", True)]
    if bad:
        out.append(kb.entry("collective_wrong_result").finding(
            evidence=[f"{op} {r['bytes']} bytes: wrong result on at least one rank" for r in bad[:5]], op=op))
    top = max(rows, key=lambda r: r["bytes"])
    busbw = float(top["busbw_gbps"])
    expect = expected_busbw(hw, nodes)
    where = "across nodes (network per GPU)" if nodes > 1 else "inside one node"
    e = kb.entry("low_busbw")
    ev = [f"{op} {top['bytes']} bytes over {top.get('ranks', '?')} ranks: busbw {busbw:.3g} GB/s; the hardware table "
          f"({hw.name}) expects about {expect:g} GB/s {where}"]
    if min_busbw and busbw < min_busbw:
        out.append(Finding(category=e.category, severity="error", id=e.id, source=e.source, evidence=ev,
                           cause=f"{op} bus bandwidth {busbw:.3g} GB/s is below the floor "
                                 f"health.preflight_min_busbw_gbps={min_busbw:g}",
                           remedy=e.remedy, extra={"op": op, "busbw_gbps": busbw, "floor_gbps": min_busbw}))
    if expect > 0 and busbw < fraction * expect:
        # CPU workers: the table's loopback figure is a rough planning number, so this is information only.
        sev = e.severity if hw.is_gpu else "info"
        out.append(Finding(category=e.category, severity=sev, id=e.id, source=e.source, evidence=ev,
                           cause=f"{op} bus bandwidth {busbw:.3g} GB/s is {busbw / expect:.0%} of the "
                                 f"{expect:g} GB/s the hardware table expects {where}. " + e.cause,
                           remedy=e.remedy, extra={"op": op, "busbw_gbps": busbw, "expected_gbps": expect}))
    return out


def hardware_for(device_name: str | None, configured: str = "auto", use_gpu: bool = False,
                 overrides: Mapping[str, float] | None = None):
    """The planner's hardware entry: the job's cluster.gpu, else guessed from the device name, else the CPU entry."""
    from rayspeed.planner import hardware

    name = configured if configured and configured != "auto" else None
    if name is None and use_gpu and device_name:
        d = device_name.lower()
        if "h200" in d:
            name = "h200"
        elif "h100" in d:
            name = "h100-pcie-80gb" if "pcie" in d else "h100-sxm-80gb"
        elif "a100" in d:
            name = "a100-40gb" if "40gb" in d else "a100-80gb"
        elif "l40s" in d:
            name = "l40s"
        else:
            name = "h100-sxm-80gb"
    if name is None:
        name = "h100-sxm-80gb" if use_gpu else "cpu"
    try:
        return hardware.get(name, dict(overrides or {}))
    except KeyError:
        return hardware.get(name)


# What each per-node measurement is called in findings and output.
NODE_METRICS = {"intra_busbw_gbps": "intra-node all-reduce busbw", "link_gbps": "link to the other nodes"}
# The per-node collectives whose result is checked (a wrong result reads -1).
WRONG_RESULT_METRICS = {"intra_busbw_gbps": "the intra-node all-reduce",
                        "cross_busbw_gbps": "the all-reduce across nodes"}


def per_node(measured: Mapping[str, Mapping[str, Any]], factor: float,
             all_nodes: list[str] | None = None) -> tuple[list[dict[str, Any]], list[Finding]]:
    """The `per_node` table and its findings. `measured`: {node: {"ranks", "intra_busbw_gbps", "link_gbps",
    "cross_busbw_gbps"}} (collectives.node_bandwidth); `all_nodes`: every node of the cluster, so nodes without
    ranks are listed too (ranks [], no figures). A node is flagged `slow` on a metric when it is below factor x
    the median of the other nodes' (compared with the others: with two nodes the slow one would otherwise drag
    the reference down). A figure of -1 is a collective that returned wrong data: listed in the row's
    `wrong_result` and reported as a `collective_wrong_result` error, never compared as a speed."""
    kb = load()
    order = list(measured) + [n for n in (all_nodes or []) if n not in measured]
    rows = {n: {"node": n, "ranks": list(measured.get(n, {}).get("ranks", [])),
                **{k: measured.get(n, {}).get(k) for k in (*NODE_METRICS, "cross_busbw_gbps")}, "slow": [],
                "wrong_result": []}
            for n in order}
    found: list[Finding] = []
    # A negative figure is the sweep's correctness marker (collectives.node_bandwidth): that collective returned
    # wrong data. It is never a speed, and always an error.
    for n, r in rows.items():
        for metric in WRONG_RESULT_METRICS:
            if r[metric] is not None and r[metric] < 0:
                r["wrong_result"].append(metric)
        if r["wrong_result"]:
            found.append(kb.entry("collective_wrong_result").finding(
                evidence=[f"node {n} (ranks {','.join(map(str, r['ranks']))}): {WRONG_RESULT_METRICS[m]} returned "
                          "wrong data" for m in r["wrong_result"]],
                node=n, metrics=list(r["wrong_result"])))
    for metric, label in NODE_METRICS.items():
        vals = {n: r[metric] for n, r in rows.items() if r[metric] is not None and r[metric] >= 0}
        for node, v, med in outliers(vals, factor):
            rows[node]["slow"].append(metric)
            found.append(kb.entry("slow_node").finding(
                evidence=[f"node {node} (ranks {','.join(map(str, rows[node]['ranks']))}): {label} {v:.3g} GB/s vs the "
                          f"other nodes' median {med:.3g} GB/s"],
                node=node, metric=metric, value=v, median_others=med))
    return list(rows.values()), found


def per_node_lines(table: list[dict[str, Any]]) -> list[str]:
    """One human line per node (healthcheck output, preflight log)."""
    def fmt(v: Any) -> str:
        return "-" if v is None else ("BAD" if v < 0 else f"{v:.3g}")

    lines = []
    for r in table:
        if not r["ranks"]:
            lines.append(f"node {r['node']}: no ranks")
            continue
        slow = f"  SLOW ({', '.join(NODE_METRICS[m] for m in r['slow'])})" if r["slow"] else ""
        if r.get("wrong_result"):
            slow += f"  WRONG RESULT ({', '.join(WRONG_RESULT_METRICS[m] for m in r['wrong_result'])})"
        lines.append(f"node {r['node']}: ranks {','.join(map(str, r['ranks']))}; intra-node all-reduce busbw "
                     f"{fmt(r['intra_busbw_gbps'])} GB/s; link to the other nodes {fmt(r['link_gbps'])} GB/s; "
                     f"all-reduce across nodes {fmt(r['cross_busbw_gbps'])} GB/s{slow}")
    return lines
