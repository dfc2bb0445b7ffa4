"""`rayspeed healthcheck`: inventory, topology and collective bandwidth of the Ray cluster, shaped like a job.

    rayspeed healthcheck [--workers N] [--json] [--config FILE [--set K=V]...] [--gpu|--cpu]
                         [--min-bytes 1K] [--max-bytes 16M] [--iters N] [--timeout S]

On the cluster at RAY_ADDRESS (or cluster.address), else a local Ray started for the check: one probe per node
(versions, GPUs, `nvidia-smi topo -m`), then N ranks in a placement group built like the job's (the same
bundles, strategy and communication environment profile) joined by torch.distributed (NCCL on GPUs, gloo on
CPUs), each measuring itself (matmul, memory copy, its link to the next rank) before all-reduce and all-gather
sweeps over message sizes. Slow ranks and nodes are flagged against the rest, bandwidth against the planner's
hardware table.

Ray actors rather than a Ray Train run: the check needs no storage, checkpoints or restarts, starts in seconds,
and a rank that hangs is bounded by a ray.get timeout instead of a failure policy.

Exit 0: the check ran and found no error; 1: it found errors (wrong collective results, a hang); 2: bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import re
import socket
import sys
import time
from typing import Any

from rayspeed.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, ConfigError

log = logging.getLogger("rayspeed.health")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?)i?B?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"size {text!r}: expected a byte count like 4096, 64K, 16M or 1G")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()])


def sizes_between(lo: int, hi: int) -> list[int]:
    """Doubling sizes from lo to hi (nccl-tests -b lo -e hi -f 2)."""
    if lo < 4 or hi < lo:
        raise ConfigError(f"--min-bytes {lo} / --max-bytes {hi}: need 4 <= min <= max")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 2
    return out


# ---------------------------------------------------------------- what runs on the cluster


def _probe_node() -> dict[str, Any]:
    """One node's inventory and topology (a Ray task pinned to that node)."""
    import ray

    from rayspeed.health import inventory, topology

    inv = inventory.collect()
    inv["node_id"] = ray.get_runtime_context().get_node_id()
    inv["ip"] = ray.util.get_node_ip_address()
    inv["topology"] = topology.probe()
    return inv


class HealthRank:
    """One rank of the check (a Ray actor in one placement-group bundle)."""

    def where(self) -> dict[str, Any]:
        import ray

        ids = ray.get_gpu_ids()
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "host": socket.gethostname(), "gpu_ids": [str(i) for i in ids]}

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(self, rank: int, world: int, addr: str, port: int, opts: dict[str, Any]) -> dict[str, Any]:
        import os

        import torch
        import torch.distributed as dist

        from rayspeed.config.env_lint import relevant_env
        from rayspeed.health import collectives
        from rayspeed.health.envprofile import lint_env

        gpu = opts["use_gpu"]
        if gpu:
            torch.cuda.set_device(0)  # Ray gives the actor one GPU through CUDA_VISIBLE_DEVICES
            device = torch.device("cuda", 0)
        else:
            torch.set_num_threads(max(1, int(opts.get("threads", 1))))
            device = torch.device("cpu")
        t0 = time.perf_counter()
        dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=opts["timeout_s"]))
        init_s = time.perf_counter() - t0
        try:
            out: dict[str, Any] = {"rank": rank, "device": str(device), "init_s": round(init_s, 3)}
            if gpu:
                out["device_name"] = torch.cuda.get_device_name(device)
                out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            out["env"] = relevant_env(os.environ)
            out["lint"] = [f.to_json() for f in lint_env(out["env"], production=opts["production"], world_size=world)]
            out.update(collectives.local_bench(device))
            out["link_gbps"] = (round(collectives.ring_sendrecv(None, opts["link_bytes"], device), 4)
                                if world > 1 else None)
            out["allreduce"] = collectives.allreduce_sweep(None, opts["sizes"], device, opts["iters"], opts["warmup"])
            out["allgather"] = collectives.allgather_sweep(None, opts["sizes"], device, opts["iters"], opts["warmup"])
            out["per_node"] = collectives.node_bandwidth(opts["nodes"], device, opts["link_bytes"], opts["iters"])
            if opts.get("calibrate"):  # `rayspeed calibrate`: what the planner's time model needs, measured here
                from rayspeed.health.calibration import measure_rank

                out["calibration"] = measure_rank(rank, world, device, opts["calibrate"])
            return out
        finally:
            dist.destroy_process_group()


# ---------------------------------------------------------------- the check


def run_healthcheck(cfg, use_gpu: bool | None = None, sizes: list[int] | None = None, iters: int | None = None,
                    timeout_s: float = 300.0, calibrate: dict | None = None) -> dict[str, Any]:
    """Connect (or start) Ray, run the check for cfg.cluster.max_workers ranks, and return the report dict.
    `calibrate`: a spec for rayspeed.health.calibration.measure_rank; each rank's result under "calibration"."""
    from rayspeed.cluster import connect_ray

    info = connect_ray(cfg)
    import ray

    try:
        if use_gpu is None:  # auto: GPUs when the cluster has one per rank
            use_gpu = float(ray.cluster_resources().get("GPU", 0)) >= cfg.cluster.max_workers
            if use_gpu and not cfg.cluster.use_gpu:
                cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, use_gpu=True))
        return _check(cfg, info, bool(use_gpu), sizes, iters, timeout_s, calibrate)
    finally:
        if info.get("started"):
            ray.shutdown()


def _check(cfg, info: dict, use_gpu: bool, sizes: list[int] | None, iters: int | None, timeout_s: float,
           calibrate: dict | None = None) -> dict:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    from rayspeed.health import analysis, topology
    from rayspeed.health.collectives import default_iters, default_sizes
    from rayspeed.health.envprofile import profile, redacted
    from rayspeed.health.knowledge import Finding, load

    kb = load()
    t0 = time.perf_counter()
    c = cfg.cluster
    world = c.max_workers
    device = "cuda" if use_gpu else "cpu"
    sizes = sizes or default_sizes(device)
    it, wu = default_iters(device)
    prof = profile(cfg, world)
    shown = redacted(prof)
    log.info("healthcheck: %d ranks (%s) on %s; %s", world, "NCCL" if use_gpu else "gloo", info["address"],
             f"env profile: {prof['tier']}" + (f" {shown['env']}" if prof["env"] else ""))

    # One probe per alive node, pinned to it (num_cpus=0: it runs even on a node whose CPUs are all reserved).
    probe = ray.remote(num_cpus=0)(_probe_node)
    nodes_alive = [n for n in ray.nodes() if n.get("Alive")]
    probes = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
              for n in nodes_alive]

    bundle = {"CPU": float(c.cpus_per_worker), **{k: float(v) for k, v in c.resources_per_worker.items()}}
    if use_gpu:
        bundle["GPU"] = 1.0
    pg = placement_group([dict(bundle) for _ in range(world)], strategy=c.placement_strategy)
    actors: list[Any] = []
    findings: list[Finding] = []
    phases: dict[str, float] = {}
    try:
        try:
            ray.get(pg.ready(), timeout=min(timeout_s, 120))
            phases["placement_s"] = round(time.perf_counter() - t0, 2)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(f"the Ray cluster could not place {world} workers of {bundle} ({c.placement_strategy}) "
                              "within 120 s: lower --workers or free the cluster") from None
        actor_cls = ray.remote(HealthRank)
        runtime_env = {"env_vars": dict(prof["env"])} if prof["env"] else None
        for i in range(world):
            opts: dict[str, Any] = dict(num_cpus=float(c.cpus_per_worker), num_gpus=1 if use_gpu else 0,
                                        resources=dict(c.resources_per_worker) or None,
                                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                                            pg, placement_group_bundle_index=i))
            if runtime_env:
                opts["runtime_env"] = runtime_env
            actors.append(actor_cls.options(**opts).remote())
        results, where, order = [], [], []
        try:
            where = ray.get([a.where.remote() for a in actors], timeout=timeout_s)
            phases["workers_s"] = round(time.perf_counter() - t0 - sum(phases.values()), 2)
            # Ranks grouped by node (then GPU), like Ray Train: a node's ranks are consecutive, so tp stays inside it.
            order = sorted(range(world), key=lambda i: (where[i]["ip"], where[i]["node_id"], where[i]["gpu_ids"]))
            addr = where[order[0]]["ip"]
            port = ray.get(actors[order[0]].free_port.remote(), timeout=timeout_s)
            opts = {"use_gpu": use_gpu, "sizes": sizes, "iters": iters or it, "warmup": wu, "timeout_s": timeout_s,
                    "production": cfg.health.production, "link_bytes": (64 << 20) if use_gpu else (4 << 20),
                    "threads": max(1, int(c.cpus_per_worker)), "nodes": [where[i]["ip"] for i in order],
                    "calibrate": calibrate}
            refs = [actors[i].run.remote(rank, world, addr, port, opts) for rank, i in enumerate(order)]
            # One at a time, so a rank that fails ends the check now instead of after the others' timeout.
            pending, deadline = list(refs), time.monotonic() + timeout_s + 30
            while pending and time.monotonic() < deadline:
                ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
                ray.get(ready)  # raises the rank's error
            if pending:
                findings.append(kb.entry("healthcheck_timeout").finding(
                    cause=f"{len(pending)} of {world} ranks did not finish the collective benchmark in "
                          f"{timeout_s + 30:.0f} s. " + kb.entry("healthcheck_timeout").cause,
                    evidence=[f"rank {rank} did not finish" for rank, ref in enumerate(refs) if ref in pending][:8]))
            else:
                results = ray.get(refs)
                phases["benchmark_s"] = round(time.perf_counter() - t0 - sum(phases.values()), 2)
        except ray.exceptions.GetTimeoutError:
            findings.append(kb.entry("healthcheck_timeout").finding(
                evidence=[f"the workers did not start within {timeout_s:.0f} s"]))
        except ray.exceptions.RayError as e:
            findings.append(kb.entry("healthcheck_rank_failed").finding(
                evidence=[line for line in str(e).splitlines() if line.strip()][-3:]))
        # Probes: one wait for all of them, so a dead node costs one timeout, not one per node.
        ready, _ = ray.wait(probes, num_returns=len(probes), timeout=60)
        node_info = []
        for n, ref in zip(nodes_alive, probes):
            try:
                if ref not in ready:
                    raise TimeoutError("no answer in 60 s")
                node_info.append(ray.get(ref))
            except Exception as e:  # a node that cannot answer is itself a finding, not a crash of the check
                node_info.append({"node_id": n["NodeID"], "ip": n.get("NodeManagerAddress"), "error": str(e)[:300]})
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)

    ranks = []
    for r in results:
        w = where[order[r["rank"]]]
        ranks.append({"rank": r["rank"], "node": w["ip"], "node_id": w["node_id"], "host": w["host"],
                      "device": r["device"], **{k: r[k] for k in ("device_name", "nccl") if k in r},
                      "gpu_ids": w["gpu_ids"], "init_s": r["init_s"], "matmul_gflops": r["matmul_gflops"],
                      "copy_gbps": r["copy_gbps"], "link_gbps": r["link_gbps"]})
    nodes_used = len({r["node_id"] for r in ranks}) or 1
    hw = analysis.hardware_for(ranks[0].get("device_name") if ranks else None, c.gpu, use_gpu, c.hardware)
    allreduce = results[0]["allreduce"] if results else []
    allgather = results[0]["allgather"] if results else []
    for row in allreduce + allgather:
        row.pop("time_s", None)
    # Variables once, with the ranks that have them.
    lint: dict[str, tuple[dict, list[int]]] = {}
    for r in results:
        for f in r["lint"]:
            lint.setdefault(f"{f['id']}={f.get('value')}", (f, []))[1].append(r["rank"])
    for f, rks in lint.values():
        base = {k: f[k] for k in ("category", "cause", "remedy", "severity", "id", "source")}
        findings.append(Finding(**base, evidence=f["evidence"],
                                extra={**{k: v for k, v in f.items() if k not in base and k != "evidence"},
                                       "ranks": rks}))
    findings += analysis.rank_findings(ranks, cfg.health.slow_rank_factor)
    findings += analysis.device_findings(ranks, hw)
    findings += analysis.bandwidth_findings(allreduce, hw, nodes_used, "allreduce")
    findings += [f for f in analysis.bandwidth_findings(allgather, hw, nodes_used, "allgather")
                 if f.id == "collective_wrong_result"]
    per_node, node_findings = analysis.per_node(results[0]["per_node"] if results else {}, cfg.health.slow_rank_factor,
                                                [n.get("ip") for n in node_info])
    findings += node_findings
    for n in node_info:
        if "error" in n:
            findings.append(kb.entry("node_probe_failed").finding(evidence=[f"node {n.get('ip')}: {n['error']}"],
                                                                  node=n.get("ip")))
        elif n.get("topology", {}).get("available"):
            findings += topology.findings(n["topology"], n.get("ip", ""))
    return {
        "cluster": {"address": info["address"], "nodes": len(nodes_alive), "nodes_used": nodes_used,
                    "resources": {k: v for k, v in info["resources"].items() if not k.startswith("node:")}},
        "backend": "nccl" if use_gpu else "gloo",
        "placement": {"bundle": bundle, "strategy": c.placement_strategy},
        "env_profile": {"tier": prof["tier"], "env": shown["env"], "notes": prof["notes"]},
        "hardware": {"name": hw.name, "expected_busbw_gbps": analysis.expected_busbw(hw, nodes_used)},
        "nodes": node_info,
        "ranks": ranks,
        "allreduce": allreduce,
        "allgather": allgather,
        "per_node": per_node,
        "findings": [f.to_json() for f in findings],
        "seconds": round(time.perf_counter() - t0, 2),
        "phases": phases,
        **({"calibration": [r.get("calibration") for r in results]} if calibrate else {}),
    }


# ---------------------------------------------------------------- output


def _human(n: int) -> str:
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)


def render(rep: dict[str, Any]) -> str:
    lines = []
    cl = rep["cluster"]
    lines.append(f"rayspeed healthcheck: {len(rep['ranks'])} ranks on {cl['nodes_used']} of {cl['nodes']} node(s), "
                 f"{rep['backend']}; hardware table {rep['hardware']['name']} expects ~"
                 f"{rep['hardware']['expected_busbw_gbps']:g} GB/s busbw; {rep['seconds']:.1f} s")
    lines.append(f"env profile: {rep['env_profile']['tier']}"
                 + (": " + " ".join(f"{k}={v}" for k, v in sorted(rep["env_profile"]["env"].items()))
                    if rep["env_profile"]["env"] else ""))
    for n in rep["nodes"]:
        if "error" in n:
            lines.append(f"node {n.get('ip')}: no answer ({n['error'][:80]})")
            continue
        gpus = f"{n['gpu_count']} GPU(s)" + (f" {n['gpus'][0]['name']}" if n.get("gpus") else "")
        topo = n.get("topology", {})
        t = (f"; NVLink pairs {topo['nvlink_pairs']}, PCIe pairs {topo['pcie_pairs']}, "
             f"NUMA {','.join(topo['numa_nodes']) or '-'}"
             if topo.get("available") else "")
        lines.append(f"node {n['ip']} ({n['hostname']}): {n['cpus']} CPUs, {n['memory_gib']} GiB, {gpus}, driver "
                     f"{n.get('driver') or '-'}, CUDA {n.get('cuda') or '-'}, NCCL {n.get('nccl') or '-'}, torch "
                     f"{n['torch']}, deepspeed {n.get('deepspeed') or '-'}, ray {n.get('ray') or '-'}{t}")
    lines.append(f"{'rank':>4} {'node':<16} {'device':<8} {'matmul GFLOP/s':>14} {'copy GB/s':>10} {'link GB/s':>10}")
    for r in rep["ranks"]:
        link = f"{r['link_gbps']:.3g}" if r.get("link_gbps") is not None else "-"
        lines.append(f"{r['rank']:>4} {r['node']:<16} {r['device']:<8} {r['matmul_gflops']:>14.4g} "
                     f"{r['copy_gbps']:>10.4g} {link:>10}")
    if rep.get("per_node"):
        from rayspeed.health.analysis import per_node_lines

        lines.append("per node (slow: below health.slow_rank_factor x the other nodes' median):")
        lines += ["  " + line for line in per_node_lines(rep["per_node"])]
    for op, factor in (("allreduce", "2(n-1)/n"), ("allgather", "(n-1)/n")):
        lines.append(f"{op} (busbw = algbw x {factor})")
        lines.append(f"{'size':>8} {'count':>10} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'ok':>3}")
        for row in rep[op]:
            lines.append(f"{_human(row['bytes']):>8} {row['count']:>10} {row['time_us']:>10.1f} "
                         f"{row['algbw_gbps']:>12.4f} {row['busbw_gbps']:>12.4f} {'ok' if row['ok'] else 'BAD':>3}")
    if rep["findings"]:
        lines.append("findings:")
        for f in rep["findings"]:
            lines.append(f"  [{f['severity']}] {f['category']}: {f['cause']}")
            for e in f.get("evidence", [])[:3]:
                lines.append(f"      {e}")
            lines.append(f"      fix: {f['remedy']}")
    else:
        lines.append("findings: none")
    return "\n".join(lines)


def job_for(args: argparse.Namespace) -> Any:
    """The job a cluster command measures for: --config (with --set), else a generic one; --workers and
    --gpu/--cpu override its cluster section. Raises ConfigError."""
    from rayspeed.config.load import load
    from rayspeed.config.schema import JobConfig

    cfg = load(args.config, args.overrides) if args.config else JobConfig()
    if args.workers is not None:
        if args.workers < 1:
            raise ConfigError(f"--workers {args.workers}: need at least 1")
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, num_workers=args.workers))
    if args.gpu is not None:
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, use_gpu=args.gpu))
    return cfg


def healthcheck_command(args: argparse.Namespace) -> int:
    from rayspeed.logs import setup

    setup()
    try:
        cfg = job_for(args)
        use_gpu = (args.gpu if args.gpu is not None
                   else (True if cfg.cluster.use_gpu else None if not args.config else False))
        sizes = None
        if args.max_bytes or args.min_bytes != "1K":
            hi = parse_bytes(args.max_bytes) if args.max_bytes else ((1 << 30) if use_gpu else (16 << 20))
            sizes = sizes_between(parse_bytes(args.min_bytes), hi)
        if args.iters is not None and args.iters < 1:
            raise ConfigError(f"--iters {args.iters}: need at least 1")
        rep = run_healthcheck(cfg, use_gpu=use_gpu, sizes=sizes, iters=args.iters, timeout_s=args.timeout)
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(rep, default=str) if args.json else render(rep), flush=True)
    return exit_code(rep)


def exit_code(rep: dict[str, Any]) -> int:
    """1 when the check found an error (a wrong collective result anywhere, the per-node table included; a hang;
    a failed rank), else 0."""
    return EXIT_FAILED if any(f["severity"] == "error" for f in rep["findings"]) else EXIT_OK
