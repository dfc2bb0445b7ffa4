"""`rayspeed calibrate [--config JOB] [--workers N] --out FILE`: measure, on this cluster and in about a minute,
what the planner's time model needs, and save it as a hardware profile (rayspeed.planner.hwprofile) that
`rayspeed plan --profile FILE` and jobs (`cluster.profile: FILE`) use.

It runs the healthcheck's ranks (same placement group, process group and sweeps: all-reduce and all-gather
bus bandwidth and latency inside a node and across the job's nodes) and, on each rank, the calibration
probes (rayspeed.health.calibration): GEMM throughput at the shapes the job's candidate layouts run,
reduce-scatter, point-to-point, host time per op, attention, and the real engine's host and step time on a
narrow stand-in of the model. The profile records the device, the node and rank counts and when it was
measured; each calibration is an MLflow run in experiment `rayspeed-calibration` with the profile as an artifact.

Exit 0: profile written; 1: the measurement failed; 2: bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import math
import socket
import statistics
import sys
from typing import Any

from rayspeed.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, ConfigError

log = logging.getLogger("rayspeed.calibrate")
EXPERIMENT = "rayspeed-calibration"
MAX_SHAPES = 24


def calibrate_command(args: argparse.Namespace) -> int:
    from rayspeed.health.healthcheck import job_for
    from rayspeed.logs import setup

    setup()
    try:
        cfg = job_for(args)
        profile = calibrate(cfg, timeout_s=args.timeout)
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_BAD_INPUT
    except RuntimeError as e:
        print(f"rayspeed calibrate: {e}", file=sys.stderr)
        return EXIT_FAILED
    from rayspeed.planner import hwprofile

    hwprofile.save(profile, args.out)
    run_id = None if args.no_mlflow else record(cfg, profile, args.out)
    print(summary(profile, args.out, run_id))
    return EXIT_OK


# ---------------------------------------------------------------- what to measure


def spec_for(cfg) -> tuple[dict, Any]:
    """The per-rank calibration spec for this job (GEMM shapes of its best candidate layouts, attention shape,
    the resolved job for the engine stand-in), and the planner's context."""
    from rayspeed.config.load import to_dict
    from rayspeed.planner import plan_job, resolve

    c = cfg
    if c.cluster.profile:  # calibrate against the built-in table, not an older profile
        c = dataclasses.replace(c, cluster=dataclasses.replace(c.cluster, profile=None))
    res = plan_job(c, top_k=8)
    resolved, _ = resolve(c)
    sh = res.ctx.shape
    h, f, kv, v = sh.hidden_size, sh.ffn_hidden_size, sh.kv_dim, sh.vocab_size
    shapes: list[list[int]] = []
    for p in [res.best] + res.alternatives:
        t, T = int(p["tp"]), int(p["micro_batch_size"]) * sh.seq_len
        for m, k, n in ((T, h, (h + 2 * kv) // t), (T, h // t, h), (T, h, 2 * f // t), (T, f // t, h), (T, h, v // t)):
            if [m, k, n] not in shapes:
                shapes.append([m, k, n])
    b = res.best
    spec = {
        "gemm_shapes": shapes[:MAX_SHAPES],
        "precision": res.ctx.precision,
        "attention": [int(b["micro_batch_size"]), max(1, sh.num_heads // int(b["tp"])), sh.seq_len, sh.head_dim],
        "model_mb": int(b["micro_batch_size"]),
        "job": to_dict(resolved),
        "p2p_bytes": [4096, 4 << 20],
    }
    return spec, res.ctx


def calibrate(cfg, timeout_s: float = 300.0) -> dict:
    """Measure on the cluster and return the profile dict."""
    from rayspeed.health.collectives import default_iters, default_sizes
    from rayspeed.health.healthcheck import run_healthcheck

    spec, ctx = spec_for(cfg)
    use_gpu = bool(cfg.cluster.use_gpu)
    device = "cuda" if use_gpu else "cpu"
    spec["sizes"] = default_sizes(device)
    spec["iters"], spec["warmup"] = default_iters(device)
    rep = run_healthcheck(cfg, use_gpu=use_gpu, timeout_s=timeout_s, calibrate=spec)
    cal = [c for c in rep.get("calibration") or [] if c]
    if not cal or not rep.get("allreduce"):
        errors = [f["cause"] for f in rep.get("findings", []) if f.get("severity") == "error"]
        raise RuntimeError("the calibration ranks did not report: " + ("; ".join(errors)[:2000] or "no result"))
    return build_profile(rep, cal, ctx, int(spec["job"]["parallel"]["zero_stage"]), job=spec["job"])


# ---------------------------------------------------------------- from measurements to a profile


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x, weighted by 1/y (relative error), a and b >= 0."""
    w = [1.0 / max(y, 1e-12) ** 2 for y in ys]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs))
    sy = sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    den = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / den if den else 0.0
    b = max(b, 1e-18)
    a = max(0.0, (sy - b * sx) / sw)
    return a, b


def _collective_fit(rows: list[dict], n: int, factor: float) -> tuple[float, float]:
    """(latency us, bus bandwidth GB/s) of t = latency + factor (n-1)/n bytes / busbw."""
    ok = [r for r in rows if r.get("ok", True) and r.get("time_us")]
    xs = [factor * (n - 1) / n * r["bytes"] for r in ok]
    ys = [r["time_us"] * 1e-6 for r in ok]
    a, b = _fit_line(xs, ys)
    return a * 1e6, 1.0 / b / 1e9


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _engine_fit(cal: list[dict], layers: int) -> dict[str, dict]:
    """Per ZeRO stage: per-block host time (fwd, bwd), fixed time per micro-batch and the step at the job's
    depth, from the stand-in's two depths (median over ranks)."""
    runs = [c["engine"] for c in cal if c.get("engine")]
    out: dict[str, dict] = {}
    for zero in (runs[0] if runs else {}):
        per = [r[zero] for r in runs if zero in r]
        d0, d1 = per[0]["depths"][0], per[0]["depths"][-1]

        def slope_icpt(key: str) -> tuple[float, float]:
            lo = _median([r[key][0] for r in per])
            hi = _median([r[key][-1] for r in per])
            slope = max(0.0, (hi - lo) / (d1 - d0))
            return slope, max(0.0, lo - slope * d0)

        fs, fi = slope_icpt("fwd_s")
        bs, bi = slope_icpt("bwd_s")
        ss, si = slope_icpt("step_s")
        out[zero] = {"host_fwd_layer_us": round(fs * 1e6, 3), "host_bwd_layer_us": round(bs * 1e6, 3),
                     "host_fixed_mb_us": round((fi + bi) * 1e6, 3), "engine_step_s": round(si + ss * layers, 6)}
    return out


def _pipeline_fit(cal: list[dict]) -> float | None:
    """The pipeline engine's host microseconds per micro-batch per stage: the step's slope over the micro-batch
    count (the slowest rank's, median over repetitions) less what the planner already puts on the slowest (last)
    stage's micro-batch: one block's host time and the fixed time per micro-batch (embedding, head, loss), from the
    pp-1 engine measurement at ZeRO-1 (timing.stage_parts). None without a measurement."""
    runs = [c["pipeline"] for c in cal if c.get("pipeline") and len(c["pipeline"].get("step_s", [])) >= 2]
    engine = _engine_fit(cal, 1).get("1")
    if not runs or not engine:
        return None
    ms = runs[0]["ms"]
    slowest = [max(r["step_s"][i] for r in runs) for i in range(len(ms))]
    slope = (slowest[-1] - slowest[0]) / (ms[-1] - ms[0])
    stage = (engine["host_fwd_layer_us"] + engine["host_bwd_layer_us"] + engine["host_fixed_mb_us"]) * 1e-6
    return round(max(0.0, slope - stage) * 1e6, 1)


def _work_scales(profile: dict, cal: list[dict], job: dict, zero: int) -> dict:
    """work_scale_fwd / work_scale_bwd / head_work_scale: the real block and the rest (the job's model through its
    engine at two depths: slope and intercept) against what the planner models for that reference layout with
    this profile's other figures; the planner then anchors there and follows its own ratios elsewhere."""
    runs = [c["model"] for c in cal if c.get("model")]
    if not runs:
        return {}
    from rayspeed.config.layout import Layout
    from rayspeed.config.load import parse
    from rayspeed.planner.search import build_ctx
    from rayspeed.planner.timing import block_cost, embed_cost, engine_overheads, head_cost

    d0, d1 = runs[0]["depths"][0], runs[0]["depths"][-1]
    mb = int(runs[0]["mb"])

    def fit(key: str) -> tuple[float, float]:
        lo, hi = _median([r[key][0] for r in runs]), _median([r[key][-1] for r in runs])
        slope = max(0.0, (hi - lo) / (d1 - d0))
        return slope, max(0.0, lo - slope * d0)

    (bf, hf), (bb, hb) = fit("fwd_s"), fit("bwd_s")
    cfg = parse(job)
    ctx = build_ctx(cfg, world_size=1, profile=profile)
    ref = Layout(1, 1, 1, zero, mb, 1)
    bc = block_cost(ctx, ref)  # modelled with this profile's figures, no scales yet
    host_f, host_b, fixed, _ = engine_overheads(ctx, ref)
    head_model = head_cost(ctx, ref)[0] + embed_cost(ctx, ref) + (0.0 if ctx.hw.is_gpu else fixed)

    def ratio(measured: float, modelled: float) -> float:
        return round(min(20.0, max(0.05, measured / modelled)), 4) if modelled > 0 and measured > 0 else 1.0

    return {"work_scale_fwd": ratio(bf, bc.fwd), "work_scale_bwd": ratio(bb, bc.bwd),
            "head_work_scale": ratio(hf + hb, head_model)}


def build_profile(rep: dict, cal: list[dict], ctx, zero: int = 0, job: dict | None = None) -> dict:
    from rayspeed.planner.comm_model import Group, nccl_s

    hw = ctx.hw
    gloo: dict[str, list] = {}
    ranks = len(rep["ranks"]) or 1
    nodes = int(rep["cluster"].get("nodes_used") or 1)
    ppn = max(1, ranks // nodes)
    gpu = hw.is_gpu
    fitted: dict[str, Any] = {}
    copy = _median([r["copy_gbps"] for r in rep["ranks"] if r.get("copy_gbps")])
    if copy:  # measured copy bandwidth is already what element-wise kernels reach
        fitted.update(hbm_gbps=round(copy, 3), mem_efficiency=1.0)
    fitted["kernel_overhead_us"] = round(_median([c["op_overhead_us"] for c in cal]), 3)

    att = _median([c.get("attention_flops", 0.0) for c in cal])
    if att:
        fitted["attention_efficiency"] = round(min(1.0, att / hw.peak(ctx.precision)), 4)
        fitted["attention_head_dim"] = ctx.shape.head_dim
    engine = _engine_fit(cal, ctx.shape.num_layers)
    own = engine.get(str(zero)) or next(iter(engine.values()), {})
    fitted.update(own)  # the job's own ZeRO stage as the default; "engine" has every stage
    pipe = _pipeline_fit(cal)
    if pipe is not None:
        fitted["pipe_host_mb_us"] = pipe
    if ranks > 1:
        lat, bw = _collective_fit(rep["allreduce"], ranks, 2.0)
        if gpu:
            big = [r["busbw_gbps"] for r in rep["allreduce"] if r["bytes"] >= (64 << 20) and r.get("ok", True)]
            busbw = max(big) if big else bw
            if nodes == 1:
                fitted["intra_node_gbps"] = round(busbw, 3)
            else:
                fitted["inter_node_gbps"] = round(busbw / ppn, 3)
            grp = Group(ranks, nodes, busbw, hw.intra_link, ll128=nodes == 1 and hw.intra_link == "nvlink")
            small = [r for r in rep["allreduce"] if r["bytes"] <= (64 << 10) and r.get("ok", True)]
            ratios = [r["time_us"] * 1e-6 / nccl_s("allreduce", float(r["bytes"]), grp) for r in small]
            if ratios:
                fitted["nccl_latency_scale"] = round(_median(ratios), 4)
        else:  # gloo: one latency and one bus bandwidth per link kind, no per-step hop (one group size measured)
            key = "intra" if nodes == 1 else "inter"
            fitted[f"{key}_node_gbps"] = round(bw, 4)
            fitted[f"{key}_latency_us"] = round(lat, 2)
            fitted[f"{key}_hop_us"] = 0.0
            rs_rows = (cal[0].get("reducescatter") or [])
            for kind, rows, factor in (("allreduce", rep["allreduce"], 2.0),
                                       ("all_gather", rep.get("allgather") or [], 1.0),
                                       ("reduce_scatter", rs_rows, 1.0)):
                if rows:
                    kl, kb = _collective_fit(rows, ranks, factor)
                    gloo[kind] = [round(kl, 2), round(kb, 4)]
    gemm = []
    by_shape: dict[tuple, list[float]] = {}
    for c in cal:
        for m, k, n, fl in c.get("gemm", []):
            by_shape.setdefault((m, k, n), []).append(fl)
    for (m, k, n), fls in by_shape.items():
        gemm.append([m, k, n, round(_median(fls), 1)])
    rs = cal[0].get("reducescatter") or []
    for row in rs:
        row.pop("time_s", None)
    dev = rep["ranks"][0].get("device_name") if rep["ranks"] else None
    profile = {
        "kind": "rayspeed-hardware-profile",
        "version": 1,
        "device": dev or ("cpu" if not gpu else hw.name),
        "gpu": hw.name,
        "nodes": nodes,
        "ranks": ranks,
        "ranks_per_node": ppn,
        "backend": rep.get("backend"),
        "measured_at": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
        "host": socket.gethostname(),
        "precision": ctx.precision,
        "hardware": fitted,
        "gemm": sorted(gemm),
        "collectives": {"allreduce": rep.get("allreduce"), "allgather": rep.get("allgather"), "reducescatter": rs,
                        "per_node": rep.get("per_node")},
        "p2p": [c.get("p2p") for c in cal],
        # The fraction of a core each rank got while busy (CPU): the load the profile was measured under. The
        # longer probes (model, engine) already ran under it, so the planner does not divide by it again.
        "cpu_share": [c.get("cpu_share") for c in cal],
        "host_probe": {"op_overhead_us": [c["op_overhead_us"] for c in cal],
                       "engine": [c.get("engine") for c in cal],
                       "pipeline": [c.get("pipeline") for c in cal]},
        "engine": engine,
        "gloo": gloo,
        "efficiency": {"compute": 1.0, "comm": 1.0, "overhead": 1.0},
        "seconds": rep.get("seconds"),
    }
    if job:
        profile["hardware"].update(_work_scales(profile, cal, job, zero))
        profile["model_probe"] = [c.get("model") for c in cal]
    return profile


# ---------------------------------------------------------------- MLflow and output


def record(cfg, profile: dict, path: str) -> str | None:
    """One MLflow run in experiment rayspeed-calibration, the profile as an artifact; None when MLflow fails
    (the profile on disk is what matters)."""
    try:
        from rayspeed.paths import tracking_uri
        from rayspeed.tracking.client import mlflow_client, set_terminated
        from rayspeed.tracking.runs import experiment_id

        uri = tracking_uri(cfg)
        client = mlflow_client(uri)
        # Its artifacts beside a local store, as a job's: not in whatever directory calibrate was run from.
        exp_id = experiment_id(client, EXPERIMENT, uri)
        name = f"calibrate-{profile['gpu']}-{profile['nodes']}n{profile['ranks']}r"
        run_id = client.create_run(exp_id, run_name=name,
                                   tags={"rayspeed.kind": "calibration", "rayspeed.job": cfg.name}).info.run_id
        for k in ("device", "gpu", "nodes", "ranks", "ranks_per_node", "backend", "precision", "measured_at", "host"):
            client.log_param(run_id, k, profile[k])
        for k, v in profile["hardware"].items():
            if isinstance(v, (int, float)) and math.isfinite(float(v)):
                client.log_metric(run_id, f"hw/{k}", float(v))
        client.log_metric(run_id, "calibrate/seconds", float(profile.get("seconds") or 0.0))
        client.log_artifact(run_id, path, artifact_path="profile")
        set_terminated(client, run_id, "FINISHED")
        return run_id
    except Exception as e:  # noqa: BLE001 - the measurement is done; tracking is a convenience
        log.warning("calibration not recorded in MLflow: %s", e)
        return None


def summary(profile: dict, path: str, run_id: str | None) -> str:
    hw = profile["hardware"]
    lines = [f"hardware profile written to {path}: {profile['device']}, {profile['ranks']} rank(s) on "
             f"{profile['nodes']} node(s), {profile['backend']}, {profile.get('seconds')} s"]
    for k in sorted(hw):
        lines.append(f"  {k:<22} {hw[k]}")
    lines.append(f"  gemm shapes measured   {len(profile['gemm'])}")
    lines.append(f"MLflow run {run_id} in experiment {EXPERIMENT}" if run_id else "not recorded in MLflow")
    lines.append(f"use it: rayspeed plan JOB --profile {path}   or   --set cluster.profile={path}")
    return "\n".join(lines)

