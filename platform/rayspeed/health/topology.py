"""GPU topology from `nvidia-smi topo -m`: NVLink vs PCIe between GPU pairs, and NUMA affinity.

parse_topo(text) -> {"gpus", "pairs": [{"a", "b", "link", "kind", "nvlinks"}], "affinity": {gpu: {cpu, numa}},
                     "nvlink_pairs", "pcie_pairs", "numa_nodes"}
probe() -> the same for this host, or {"available": False, "reason"} where nvidia-smi is missing
findings(topo) -> Findings (GPU pairs without NVLink, GPUs spread over NUMA nodes)
"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

from rayspeed.health.knowledge import Finding, load

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DEV = re.compile(r"^(GPU\d+|NIC\d+|mlx\S*)$")

# nvidia-smi's legend, best first.
KINDS = {
    "X": "self",
    "NV": "nvlink",  # NV# = a bonded set of # NVLinks
    "PIX": "pcie",  # at most one PCIe bridge
    "PXB": "pcie",  # several PCIe bridges, no host bridge
    "PHB": "pcie_host",  # through a PCIe host bridge (the CPU)
    "NODE": "pcie_numa",  # across host bridges inside one NUMA node
    "SYS": "cross_numa",  # across the SMP interconnect between NUMA nodes (QPI/UPI)
    "SOC": "cross_numa",  # older drivers' name for SYS
}


def _kind(link: str) -> tuple[str, int]:
    link = link.strip()
    m = re.match(r"^NV(\d+)$", link)
    if m:
        return "nvlink", int(m.group(1))
    return KINDS.get(link, "unknown"), 0


def parse_topo(text: str) -> dict[str, Any]:
    lines = [_ANSI.sub("", l).rstrip() for l in text.splitlines()]
    # The header is the first line that starts blank and names GPU0; the rows start with the device name.
    header_i = next((i for i, l in enumerate(lines) if l[:1].isspace() and re.search(r"\bGPU0\b", l)), None)
    if header_i is None:
        raise ValueError("no `nvidia-smi topo -m` matrix found (no header line naming GPU0)")
    header = lines[header_i]
    if "\t" in header:
        cols = [c.strip() for c in header.split("\t")][1:]
    else:
        cols = re.split(r"\s{2,}", header.strip())
    devs = [c for c in cols if _DEV.match(c)]
    extra = [c for c in cols if c and not _DEV.match(c)]  # CPU Affinity, NUMA Affinity, GPU NUMA ID
    gpus = [d for d in devs if d.startswith("GPU")]
    matrix: dict[str, dict[str, str]] = {}
    affinity: dict[str, dict[str, str]] = {}
    for line in lines[header_i + 1:]:
        if not line.strip() or line.strip().startswith("Legend"):
            break
        if "\t" in line:
            cells = [c.strip() for c in line.split("\t")]
        else:
            cells = line.split()
        name = cells[0]
        if not _DEV.match(name):
            continue
        links = cells[1:1 + len(devs)]
        matrix[name] = dict(zip(devs, links))
        rest = [c for c in cells[1 + len(devs):]]
        if name.startswith("GPU"):
            info = dict(zip(extra, rest)) if "\t" in line else {}
            if not info and rest:  # space-separated: CPU affinity is one token, then the NUMA node
                info = {"CPU Affinity": rest[0]}
                if len(rest) > 1:
                    info["NUMA Affinity"] = rest[1]
            affinity[name] = {"cpu": info.get("CPU Affinity", ""), "numa": info.get("NUMA Affinity", "")}
    pairs = []
    for i, a in enumerate(gpus):
        for b in gpus[i + 1:]:
            link = matrix.get(a, {}).get(b, "")
            kind, n = _kind(link)
            pairs.append({"a": a, "b": b, "link": link, "kind": kind, "nvlinks": n})
    numa = sorted({v["numa"] for v in affinity.values() if v["numa"] not in ("", "N/A")})
    return {
        "available": True,
        "gpus": gpus,
        "nics": [d for d in devs if not d.startswith("GPU")],
        "pairs": pairs,
        "affinity": affinity,
        "nvlink_pairs": sum(p["kind"] == "nvlink" for p in pairs),
        "pcie_pairs": sum(p["kind"] != "nvlink" for p in pairs),
        "numa_nodes": numa,
    }


def probe(timeout_s: float = 20.0) -> dict[str, Any]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {"available": False, "reason": "nvidia-smi not found (no NVIDIA driver on this node)"}
    try:
        r = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"available": False, "reason": f"nvidia-smi topo -m failed: {e}"}
    if r.returncode != 0:
        return {"available": False, "reason": f"nvidia-smi topo -m exited {r.returncode}: {r.stderr.strip()[:200]}"}
    try:
        topo = parse_topo(r.stdout)
    except ValueError as e:
        return {"available": False, "reason": str(e), "raw": r.stdout[:2000]}
    return topo


def findings(topo: dict[str, Any], node: str = "") -> list[Finding]:
    if not topo.get("available"):
        return []
    kb = load()
    out = []
    where = f" on {node}" if node else ""
    slow = [p for p in topo["pairs"] if p["kind"] != "nvlink"]
    if topo["nvlink_pairs"] and slow:
        ev = [f"{p['a']}-{p['b']}: {p['link']} ({p['kind']})" for p in slow[:8]]
        out.append(kb.entry("gpu_pairs_without_nvlink").finding(
            evidence=ev, node=node,
            cause=f"{len(slow)} of {len(topo['pairs'])} GPU pairs{where} have no NVLink: "
                  + kb.entry("gpu_pairs_without_nvlink").cause))
    elif slow and len(topo["gpus"]) > 1:
        ev = [f"{p['a']}-{p['b']}: {p['link']} ({p['kind']})" for p in slow[:8]]
        e = kb.entry("gpu_pairs_without_nvlink")
        out.append(Finding(category=e.category, severity="info", id=e.id, source=e.source, evidence=ev,
                           cause=f"no NVLink between the GPUs{where}: every pair talks over PCIe",
                           remedy="keep parallel.tp at 1 or 2 here (tensor parallelism over PCIe loses most of its "
                                  "gain); prefer data parallel / ZeRO", extra={"node": node}))
    if len(topo["numa_nodes"]) > 1:
        ev = [f"{g}: NUMA {a['numa']}, CPUs {a['cpu']}" for g, a in topo["affinity"].items()]
        out.append(kb.entry("gpus_span_numa").finding(evidence=ev, node=node))
    return out
