"""What one collective costs.

GPUs: NCCL's own cost model, the one NCCL uses to pick an algorithm and protocol for every call
(NVIDIA/nccl src/graph/tuning.cc, `ncclTopoTuneModel` + `ncclTopoGetAlgoTime`, NCCL 2.19-2.23): for ring
and tree and the LL, LL128 and Simple protocols, a latency (a base plus one hop per algorithm step, the
steps that cross nodes paying the network's hop) and an algorithm bandwidth derived from the bus bandwidth;
the cheapest combination wins, as in NCCL. The bus bandwidths are the achievable ones of the hardware table
(nccl-tests busbw at large messages), not link peaks. So the cost grows with the number of ranks (a ring of
n ranks takes 2(n-1) steps for an all-reduce), with the number of nodes (network hops cost ~14 us against
~3.4 us on NVLink), and small buckets are latency-bound.

CPUs (gloo over TCP): latency + bytes / bandwidth with one hop per ring step (`collective_s`, `Link`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

# ---------------------------------------------------------------- NCCL's constants (tuning.cc, 2.19-2.23)

LL, LL128, SIMPLE = 0, 1, 2
PROTOCOLS = (LL, LL128, SIMPLE)
# Base latency per call (us), [LL, LL128, Simple].
BASE_LAT = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4)}
# Latency per algorithm step (us) by link type, [LL, LL128, Simple].
HW_LAT = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0)},
}
NET_OVERHEAD_US = 1.0  # getNetOverhead on Intel x86 hosts (2.0 on AMD); x3 for Simple
RING_PLATEAU = 1.4  # multi-node ring/Simple all-reduce latency factor on Ampere and newer ("plateau effect")
TREE_ALLREDUCE_BW = 0.92  # tree all-reduce bus bandwidth factor
TREE_PATTERN_BW = 0.85  # tree pattern (multi-node) bandwidth factor
LL128_BW = 0.92  # LL128 payload efficiency (120/128 bytes of every line carry data)
LL_MAX_GBPS = {1: 141.0, 2: 39.0, 4: 20.4}  # llMaxBws: Hopper single node; Intel hosts at 2 and 4+ nodes
# treeCorrectionFactor for Simple, by log2(bytes/64) = 0..21 (64 B .. 128 MiB); 1.0 beyond.
TREE_CORRECTION_SIMPLE = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9)
CHANNELS = 16  # typical ring channels on an 8-GPU NVSwitch node (only used for the plateau threshold)
# Rings degrade at scale (NCCL's maintainers, NVIDIA/nccl#1649): H100 reduce-scatter busbw measured at 4, 8, 16, 32,
# 64 and 128 nodes fell linearly per doubling, 360, 345, 320, 300, 280, 260 GB/s (NVIDIA/nccl#1229): 100/360 over
# five doublings. Every ring across more than RING_SCALE_FROM nodes loses that share of its bus bandwidth per
# doubling; trees (log-depth) keep theirs, so NCCL's own pick (and this model's) moves to trees where they win.
RING_SCALE_FROM = 4
RING_LOSS_PER_DOUBLING = 100.0 / 360.0 / 5.0


@dataclass(frozen=True)
class Group:
    """A communicator as NCCL sees it."""
    ranks: int
    nodes: int
    busbw_gbps: float  # ring/Simple bus bandwidth at large messages (nccl-tests busbw), what the slowest hop allows
    intra: str = "nvlink"  # nvlink | pci: the link inside a node
    # LL128 is on by default only inside an NVLink node (tuning.cc protoEnable: not over the network)
    ll128: bool = True
    latency_scale: float = 1.0  # a calibrated profile's measured / modelled latency
    # "" = NCCL's tuner picks per call (the cheapest below); "tree" = NCCL_ALGO=Tree: all-reduces run as trees, inside
    # a node too (a chain), while the other collectives have no tree and fall back to rings (NVIDIA/nccl#317,
    # #1304; before NCCL 2.22 the fallback could fail with "no algorithm/protocol available").
    algo: str = ""


@functools.lru_cache(maxsize=65536)
def nccl_s(kind: str, nbytes: float, g: Group) -> float:
    """Seconds for one NCCL call of `kind` (allreduce | all_gather | reduce_scatter) moving `nbytes`
    (the full buffer: the all-reduce input, the all-gather output, the reduce-scatter input)."""
    n, nodes = g.ranks, max(1, g.nodes)
    if n <= 1 or nbytes <= 0:
        return 0.0
    ppn = max(1.0, n / nodes)
    ar = kind == "allreduce"
    nsteps = 2 * (n - 1) if ar else n - 1
    ninter = 0 if nodes == 1 else (2 * (nodes - 1) if ar else nodes - 1)
    best = math.inf
    algos = ("ring", "tree") if (ar and nodes > 1) else ("ring",)
    if g.algo == "tree" and ar:
        algos = ("tree",)
    for algo in algos:
        for p in PROTOCOLS:
            if p == LL128 and not g.ll128:
                continue
            bw = _algo_bw(algo, p, kind, n, nodes, g.busbw_gbps)
            if bw <= 0:
                continue
            lat = BASE_LAT[algo][p]
            intra_lat = HW_LAT[g.intra][algo][p]
            inter_lat = HW_LAT["net"][algo][p]
            if nodes > 1 and p == LL:
                intra_lat *= 1.8
            if algo == "ring":
                if nodes > 1:
                    intra_lat = max(intra_lat, NET_OVERHEAD_US * (3 if p == SIMPLE else 1))
                lat += (nsteps - ninter) * intra_lat + ninter * inter_lat
                if p == SIMPLE and ar and nodes > 1 and nbytes / (CHANNELS * n) >= 64:
                    lat *= RING_PLATEAU
            else:
                lat += 2 * ((ppn - 1) * intra_lat + int(math.log2(nodes)) * inter_lat)
                log_size = int(math.log2(max(1.0, nbytes / 64)))
                if p == SIMPLE and log_size < len(TREE_CORRECTION_SIMPLE):
                    bw *= TREE_CORRECTION_SIMPLE[log_size]
            t = lat * g.latency_scale * 1e-6 + nbytes / (bw * 1e9)
            best = min(best, t)
    return best


def ring_scale(nodes: int) -> float:
    """The share of its bus bandwidth a ring keeps across `nodes` nodes (1.0 up to RING_SCALE_FROM)."""
    if nodes <= RING_SCALE_FROM:
        return 1.0
    return max(0.5, 1.0 - RING_LOSS_PER_DOUBLING * math.log2(nodes / RING_SCALE_FROM))


def _algo_bw(algo: str, p: int, kind: str, n: int, nodes: int, busbw: float) -> float:
    """Algorithm bandwidth (GB/s, bytes of the buffer per second) of one algorithm/protocol."""
    ll_max = LL_MAX_GBPS[1 if nodes == 1 else 2 if nodes == 2 else 4]
    if algo == "ring":
        bw = busbw * ring_scale(nodes)
        if p == LL:
            bw = min(ll_max, bw * 0.5)
        elif p == LL128:
            bw *= LL128_BW
        # bus -> algorithm bandwidth: an all-reduce moves 2(n-1)/n of the buffer per rank, the others (n-1)/n.
        return bw * n / (2 * (n - 1) if kind == "allreduce" else (n - 1))
    bw = busbw * TREE_ALLREDUCE_BW
    if p == LL:
        bw = min(bw / 3.8, ll_max)
    elif p == LL128:
        bw *= 120.0 / 128.0
    bw *= TREE_PATTERN_BW
    return bw * 0.5


# ---------------------------------------------------------------- gloo (CPU) and a generic alpha-beta link


@dataclass(frozen=True)
class Link:
    gbps: float  # bus bandwidth
    base_us: float  # fixed cost per call
    hop_us: float  # cost per algorithm step


def collective_s(nbytes: float, ranks: int, link: Link, kind: str, calls: int = 1) -> float:
    """Latency-bandwidth cost: (n-1)/n * bytes / bus bandwidth (twice for all-reduce) plus, per call, a fixed cost
    and one hop per algorithm step: a ring all-gather or reduce-scatter takes n - 1 steps, an all-reduce runs
    as a tree (2 log2 n steps) or a ring, whichever is shorter."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    factor = 2.0 if kind == "allreduce" else 1.0
    steps = min(2 * (ranks - 1), 2 * math.ceil(math.log2(ranks))) if kind == "allreduce" else ranks - 1
    calls = max(1, calls)
    return (factor * (ranks - 1) / ranks * nbytes / (link.gbps * 1e9)
            + calls * (link.base_us + steps * link.hop_us) * 1e-6)


def bucketed(cost_one, nbytes: float, bucket_bytes: float) -> float:
    """A buffer sent as full buckets plus a remainder, one call each (DeepSpeed's bucketed reduce/gather)."""
    if nbytes <= 0:
        return 0.0
    bucket_bytes = max(1.0, min(bucket_bytes, nbytes))
    full = int(nbytes // bucket_bytes)
    rest = nbytes - full * bucket_bytes
    return full * cost_one(bucket_bytes) + (cost_one(rest) if rest > 0.5 else 0.0)
