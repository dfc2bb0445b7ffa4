"""nccl-tests-style collective benchmarks on an already-initialized torch.distributed group.

    allreduce_sweep(group=None, sizes=None, device="cpu") -> [{bytes, count, algbw_gbps, busbw_gbps, time_s, ok}]
    allgather_sweep(...)                                   -> same, bytes = the gathered (output) size
    reducescatter_sweep(...)                               -> same, bytes = the input size
    ring_sendrecv(group, nbytes, device)                   -> this rank's send bandwidth to the next rank (GB/s)
    local_bench(device)                                    -> {matmul_gflops, copy_gbps}: this rank alone

Bandwidths follow nccl-tests (GB/s = 1e9 bytes/s): algbw = bytes / time; busbw corrects it to what each link
carries, so it is comparable with the hardware's bandwidth whatever the rank count: all-reduce 2(n-1)/n,
all-gather and reduce-scatter (n-1)/n. Every rank must call a sweep with the same arguments (the calls are
collective). The time of a size is the slowest rank's, so every rank returns the same table.

On GPUs the tensors live on the device and the timing is bracketed by torch.cuda.synchronize (NCCL calls
return once the kernel is queued); on CPU gloo calls return when the data has arrived.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

ELEMENT = torch.float32
ELEMENT_BYTES = 4


def busbw_factor(op: str, n: int) -> float:
    if n <= 1:
        return 1.0
    if op == "allreduce":
        return 2.0 * (n - 1) / n
    if op in ("allgather", "reducescatter"):
        return (n - 1) / n
    return 1.0


def _device(device: Any) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def default_sizes(device: Any = "cpu") -> list[int]:
    """nccl-tests' doubling sweep: 1 KiB..16 MiB on CPU (gloo over loopback or Ethernet), 1 KiB..1 GiB on GPUs."""
    top = 30 if _device(device).type == "cuda" else 24
    return [2**k for k in range(10, top + 1)]


def default_iters(device: Any = "cpu") -> tuple[int, int]:
    """(iters, warmup): GPU collectives are microseconds, so more repetitions; gloo's are milliseconds."""
    return (20, 5) if _device(device).type == "cuda" else (5, 1)


def _sweep_settings(device: Any, iters: int | None, warmup: int | None) -> tuple[torch.device, int, int]:
    """A sweep's device and its (iters, warmup), the device's defaults where not given."""
    dev = _device(device)
    it, wu = default_iters(dev)
    return dev, iters or it, wu if warmup is None else warmup


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _align(group) -> None:
    # A barrier made of a one-element all-reduce: works on every backend without the device-id guessing of
    # dist.barrier under NCCL.
    dev = _group_device(group)
    t = torch.zeros(1, device=dev)
    dist.all_reduce(t, group=group)
    _sync(dev)


def _group_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _timed(fn: Callable[[], Any], iters: int, warmup: int, device: torch.device, group) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    _align(group)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / max(1, iters)


def _finish(op: str, rows: list[dict], times: list[float], oks: list[bool], device: torch.device, group) -> list[dict]:
    """The slowest rank's time per size and whether every rank's check passed, reduced in one collective."""
    n = dist.get_world_size(group)
    t = torch.tensor(times + [0.0 if ok else 1.0 for ok in oks], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    vals = t.tolist()
    k = len(rows)
    for i, row in enumerate(rows):
        sec = max(vals[i], 1e-12)
        algbw = row["bytes"] / sec / 1e9
        row.update(time_s=sec, time_us=round(sec * 1e6, 2), algbw_gbps=round(algbw, 6),
                   busbw_gbps=round(algbw * busbw_factor(op, n), 6), ok=vals[k + i] == 0.0, ranks=n)
    return rows


def allreduce_sweep(group=None, sizes: list[int] | None = None, device: Any = "cpu", iters: int | None = None,
                    warmup: int | None = None) -> list[dict]:
    """In-place sum all-reduce of float32 buffers of each size (bytes)."""
    dev, iters, warmup = _sweep_settings(device, iters, warmup)
    n = dist.get_world_size(group)
    rows, times, oks = [], [], []
    for size in sizes or default_sizes(dev):
        count = max(1, int(size) // ELEMENT_BYTES)
        x = torch.ones(count, dtype=ELEMENT, device=dev)
        dist.all_reduce(x, group=group)  # correctness: every element is n
        _sync(dev)
        oks.append(bool(x[0].item() == n and x[-1].item() == n))
        x.zero_()  # zeros stay zeros: repeated in-place sums cannot overflow
        times.append(_timed(lambda x=x: dist.all_reduce(x, group=group), iters, warmup, dev, group))
        rows.append({"op": "allreduce", "bytes": count * ELEMENT_BYTES, "count": count, "dtype": "float32",
                     "iters": iters})
        del x
    return _finish("allreduce", rows, times, oks, dev, group)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def allgather_sweep(group=None, sizes: list[int] | None = None, device: Any = "cpu", iters: int | None = None,
                    warmup: int | None = None) -> list[dict]:
    """All-gather into one buffer; `bytes` is the gathered (output) size, as in nccl-tests."""
    dev, iters, warmup = _sweep_settings(device, iters, warmup)
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    rows, times, oks = [], [], []
    for size in sizes or default_sizes(dev):
        per_rank = max(1, int(size) // (ELEMENT_BYTES * n))
        inp = torch.full((per_rank,), float(me + 1), dtype=ELEMENT, device=dev)
        out = torch.empty(per_rank * n, dtype=ELEMENT, device=dev)
        _all_gather(out, inp, group)
        _sync(dev)
        oks.append(bool(out[0].item() == 1 and out[-1].item() == n))
        times.append(_timed(lambda out=out, inp=inp: _all_gather(out, inp, group), iters, warmup, dev, group))
        rows.append({"op": "allgather", "bytes": per_rank * n * ELEMENT_BYTES, "count": per_rank * n,
                     "dtype": "float32", "iters": iters})
        del inp, out
    return _finish("allgather", rows, times, oks, dev, group)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def reducescatter_sweep(group=None, sizes: list[int] | None = None, device: Any = "cpu", iters: int | None = None,
                        warmup: int | None = None) -> list[dict]:
    """Sum reduce-scatter from one buffer; `bytes` is the input size, as in nccl-tests."""
    dev, iters, warmup = _sweep_settings(device, iters, warmup)
    n = dist.get_world_size(group)
    rows, times, oks = [], [], []
    for size in sizes or default_sizes(dev):
        per_rank = max(1, int(size) // (ELEMENT_BYTES * n))
        inp = torch.ones(per_rank * n, dtype=ELEMENT, device=dev)
        out = torch.empty(per_rank, dtype=ELEMENT, device=dev)
        _reduce_scatter(out, inp, group)
        _sync(dev)
        oks.append(bool(out[0].item() == n and out[-1].item() == n))
        inp.zero_()
        times.append(_timed(lambda out=out, inp=inp: _reduce_scatter(out, inp, group), iters, warmup, dev, group))
        rows.append({"op": "reducescatter", "bytes": per_rank * n * ELEMENT_BYTES, "count": per_rank * n,
                     "dtype": "float32", "iters": iters})
        del inp, out
    return _finish("reducescatter", rows, times, oks, dev, group)


def ring_sendrecv(group=None, nbytes: int = 4 << 20, device: Any = "cpu", iters: int = 3) -> float:
    """Each rank sends `nbytes` to the next rank of the group while receiving from the previous one; returns this
    rank's send bandwidth (GB/s). A slow link shows up on the rank that sends over it."""
    dev = _device(device)
    n = dist.get_world_size(group)
    if n < 2:
        return 0.0
    me = dist.get_rank(group)
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    count = max(1, nbytes // ELEMENT_BYTES)
    send = torch.ones(count, dtype=ELEMENT, device=dev)
    recv = torch.empty(count, dtype=ELEMENT, device=dev)

    def exchange():
        ops = [dist.P2POp(dist.isend, send, glob((me + 1) % n), group=group),
               dist.P2POp(dist.irecv, recv, glob((me - 1) % n), group=group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    sec = _timed(exchange, iters, 1, dev, group)
    return count * ELEMENT_BYTES / max(sec, 1e-12) / 1e9


def _best(fn: Callable[[], Any], reps: int, device: torch.device) -> float:
    # The fastest repetition: what the device can do, not how often the OS preempted it (workers may share cores).
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def local_bench(device: Any = "cpu", quick: bool = False) -> dict[str, float]:
    """This rank alone: matmul throughput and memory-copy bandwidth, to tell a slow device from a slow link."""
    dev = _device(device)
    gpu = dev.type == "cuda"
    m = (4096 if gpu else 256) if quick else (8192 if gpu else 512)
    dtype = torch.bfloat16 if gpu else torch.float32
    a = torch.randn(m, m, device=dev, dtype=dtype)
    b = torch.randn(m, m, device=dev, dtype=dtype)
    reps = 3 if quick else 5
    torch.mm(a, b)
    _sync(dev)
    mm_s = _best(lambda: torch.mm(a, b), reps, dev)
    nbytes = (256 << 20 if gpu else 8 << 20) if quick else (1 << 30 if gpu else 32 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(dev)
    cp_s = _best(lambda: dst.copy_(src), reps, dev)
    # A copy reads and writes every byte: 2 x nbytes of traffic.
    return {"matmul_gflops": round(2 * m**3 / max(mm_s, 1e-12) / 1e9, 2),
            "copy_gbps": round(2 * nbytes / max(cp_s, 1e-12) / 1e9, 2)}


def gather_floats(values: list[float], group=None) -> list[list[float]]:
    """Every rank's list of floats (same length everywhere), on every rank, in one collective."""
    dev = _group_device(group)
    n = dist.get_world_size(group)
    inp = torch.tensor(values, dtype=torch.float64, device=dev)
    out = torch.empty(n * len(values), dtype=torch.float64, device=dev)
    _all_gather(out, inp, group)
    flat = out.tolist()
    k = len(values)
    return [flat[r * k:(r + 1) * k] for r in range(n)]


def node_bandwidth(nodes: list[str], device: Any = "cpu", nbytes: int = 1 << 20, iters: int = 3) -> dict[str, dict]:
    """Per-node figures for a world that spans nodes; `nodes[r]` is the node of global rank r. Collective: every
    rank of the world calls it with the same list. Returns, on every rank, {node: {"ranks", "intra_busbw_gbps",
    "link_gbps", "cross_busbw_gbps"}}:

    - intra_busbw_gbps: an all-reduce of nbytes among the node's own ranks (None for a one-rank node). Every
      node measures at once, over disjoint groups, as tp groups do in training.
    - link_gbps: the node's first rank sending nbytes to the next node's first rank while receiving from the
      previous one (a ring over one rank per node): this node's outgoing link. None with a single node.
    - cross_busbw_gbps: an all-reduce among one rank per node (the same figure for every node): the data-parallel
      gradient sync across nodes.
    A wrong all-reduce result reads -1.
    """
    dev = _device(device)
    order = list(dict.fromkeys(nodes))
    members = {n: [r for r, x in enumerate(nodes) if x == n] for n in order}
    me = dist.get_rank()
    # dist.new_group is collective over the whole world, in the same order everywhere.
    intra = {n: dist.new_group(members[n]) for n in order if len(members[n]) > 1}
    leaders = [members[n][0] for n in order]
    cross = dist.new_group(leaders) if len(order) > 1 else None
    nan = float("nan")
    mine = [nan, nan, nan]
    try:
        node = nodes[me]
        if node in intra:
            row = allreduce_sweep(intra[node], [nbytes], dev, iters, 1)[0]
            mine[0] = row["busbw_gbps"] if row["ok"] else -1.0
        if cross is not None and me in leaders:
            mine[1] = ring_sendrecv(cross, nbytes, dev, iters)
            row = allreduce_sweep(cross, [nbytes], dev, iters, 1)[0]
            mine[2] = row["busbw_gbps"] if row["ok"] else -1.0
        every = gather_floats(mine)
    finally:
        for g in list(intra.values()) + ([cross] if cross is not None else []):
            dist.destroy_process_group(g)

    def val(x: float) -> float | None:
        return None if x != x else round(x, 6)

    return {n: {"ranks": members[n], "intra_busbw_gbps": val(every[members[n][0]][0]),
                "link_gbps": val(every[members[n][0]][1]), "cross_busbw_gbps": val(every[members[n][0]][2])}
            for n in order}
