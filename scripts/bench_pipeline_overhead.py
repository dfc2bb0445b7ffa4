"""DeepSpeed's pipeline engine's fixed host cost per micro-batch (CPU, gloo, pp=2, dp=1, fp32), for the planner.

A tiny Transformer (hidden 16, 2 layers, vocab 256: the byte tokenizer's minimum, seq 8, micro-batch 1: compute
is negligible) goes through the platform's own path: rayspeed.config.parse -> engine.deepspeed_config ->
engine.build.build_engine (the rayspeed pipeline module, its optimizer and scheduler, deepspeed.initialize ->
PipelineEngine, ZeRO-1). For each m
(gradient accumulation steps = micro-batches per step) a fresh engine warms up 3 steps, then 5 train_batch()
steps are timed (a barrier before and after each); one JSON line per m with the median step seconds. A least-
squares fit step_s = a + b*m gives:

  b  seconds per micro-batch. With p=2, DeepSpeed's TrainSchedule meets the two stages once per micro-batch (at
     step 2k+1: stage 1 SendGrad(k-1) -> stage 0 RecvGrad(k-1), then stage 0 SendActivation(k) -> stage 1
     RecvActivation(k)); between meetings stage 0 runs Backward(k-1) + LoadMicroBatch + Forward(k+1) and stage 1
     runs Forward(k) (+ its LoadMicroBatch of the labels) + Backward(k). The stages run side by side (one
     process, one core each), so b ~= max(busy_0, busy_1 + one tiny-tensor round trip): the busier stage's
     instructions for one micro-batch (its share of the compute + the engine's host work around it) plus the
     latency of the meeting. b is therefore a per-stage figure (the critical stage's), not a sum over stages.
  a  the per-step fixed cost: ReduceTiedGrads / ReduceGrads / OptimizerStep (ZeRO-1 AdamW on ~10k parameters),
     the loss broadcast between stages, schedule set-up, the p-1 extra fill/drain step pairs, the barriers.

The script also measures, to take apart b:
  compute  the same model's forward + backward per micro-batch in plain torch, one process (the whole model and
           each stage's part: stage 0 = embed + layer 0, stage 1 = layer 1 + norm + head + loss);
  p2p      a gloo dist.send/recv ping-pong of the [1, 8, 16] fp32 activation between the two ranks (one way =
           round trip / 2);
  busy     per rank, the step time minus the time spent inside the engine's p2p.recv calls (waiting for the
           other stage), fitted against m the same way: each stage's own seconds per micro-batch.
engine_host_s_per_microbatch = b - compute of the critical stage - one round trip (the meeting's two one-way
transfers); engine_host_busy_s = max over stages of (busy slope - that stage's compute), the same quantity from
the recv-wait bookkeeping instead of the latency model. Medians are the headline; "min_fit" repeats the fit on
each m's fastest step (and the fastest compute / round trip), the less contended estimate on a shared machine.

    OMP_NUM_THREADS=1 PYTHONPATH=platform python scripts/bench_pipeline_overhead.py [--ms 1,2,4,8,16,32,64]
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import platform as host_platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

MODEL = dict(hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2, ffn_hidden_size=32, vocab_size=256,
             seq_len=8, tie_embeddings=False)
MICRO = 1


def _fit(xs, ys):
    """Least squares y = a + b x: (a, b)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _batch():
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, MODEL["vocab_size"], (MICRO, MODEL["seq_len"]), generator=g),
            torch.randint(0, MODEL["vocab_size"], (MICRO, MODEL["seq_len"]), generator=g))


def job_cfg(m):
    from rayspeed.config import parse

    model = {k: v for k, v in MODEL.items()}
    return parse({
        "name": "pipeoh", "model": model,
        "train": {"global_batch_size": MICRO * m, "precision": "fp32", "max_steps": 1000, "warmup_steps": 0,
                  "lr": 1e-3},
        "parallel": dict(dp=1, tp=1, pp=2, zero_stage=1, micro_batch_size=MICRO, grad_accum=m,
                         sequence_parallel=False, activation_checkpointing="none"),
        "cluster": {"num_workers": 2},
    })


def compute_per_microbatch(reps=300):
    """Plain torch, one process: forward + backward seconds per micro-batch (median of `reps`), whole model and
    per stage."""
    from rayspeed.model import Transformer

    model = Transformer(SimpleNamespace(**MODEL), seed=0)
    ids, labels = _batch()

    def whole():
        model(ids, labels).backward()

    def stage0():
        x = model.embed(ids)
        x = model.layers[0](x, None)
        x.backward(torch.ones_like(x))

    h = model.layers[0](model.embed(ids), None).detach()

    def stage1():
        x = h.clone().requires_grad_(True)
        x = model.layers[1](x, None)
        model.head.loss(model.norm(x), labels).backward()

    out = {}
    for name, fn in (("whole", whole), ("stage0", stage0), ("stage1", stage1)):
        for _ in range(20):
            fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        out[name], out[name + "_min"] = statistics.median(ts), min(ts)
    return out


def p2p_round_trip(rank, reps=500):
    """gloo send/recv ping-pong of one activation-sized tensor: median round-trip seconds."""
    import torch.distributed as dist

    t = torch.zeros(MICRO, MODEL["seq_len"], MODEL["hidden_size"])
    ts = []
    for i in range(reps + 50):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
        if i >= 50:
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts)


class RecvClock:
    """Seconds spent inside the pipeline engine's p2p.recv (waiting for the other stage)."""

    def __init__(self):
        self.p2p = importlib.import_module("deepspeed.runtime.pipe.p2p")
        self.orig, self.total = self.p2p.recv, 0.0

        def recv(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return self.orig(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0

        self.p2p.recv = recv


def _worker(rank, world_size, ms, warmup, steps, port, result_path):
    import datetime

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
    if hasattr(ds_comm_torch, "build_shm_op"):  # CPU accelerator: skip the JIT-built inference op
        ds_comm_torch.build_shm_op = lambda: None
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    deepspeed.init_distributed(dist_backend="gloo")
    from rayspeed.engine.build import build_engine
    from rayspeed.engine.deepspeed_config import deepspeed_config
    from rayspeed.parallel.groups import ParallelGroups

    rtt, rtt_min = p2p_round_trip(rank)
    clock = RecvClock()
    batch = _batch()
    rows = []
    for m in ms:
        cfg = job_cfg(m)
        engine, pipelined = build_engine(cfg, deepspeed_config(cfg), ParallelGroups(1, 1, 2), torch.device("cpu"))
        assert pipelined and engine.micro_batches == m
        data = iter(lambda: batch, None)  # endless: the same micro-batch
        for _ in range(warmup):
            engine.train_batch(data_iter=data)
        times, busy = [], []
        for _ in range(steps):
            dist.barrier()
            clock.total = 0.0
            t0 = time.perf_counter()
            engine.train_batch(data_iter=data)
            dist.barrier()
            dt = time.perf_counter() - t0
            times.append(dt)
            busy.append(dt - clock.total)
        rows.append({"m": m, "step_s": statistics.median(times), "busy_s": statistics.median(busy),
                     "step_min_s": min(times),
                     "steps_s": times, "stage": engine.stage_id})
        del engine
    out = {"rank": rank, "rtt_s": rtt, "rtt_min_s": rtt_min, "rows": rows}
    if rank == 0:
        out["compute"] = compute_per_microbatch()  # ranks idle meanwhile; after the timed runs
    dist.barrier()
    torch.save(out, f"{result_path}.{rank}")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default="1,2,4,8,16,32,64")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    ms = [int(x) for x in a.ms.split(",")]
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result")
        mp.start_processes(_worker, args=(2, ms, a.warmup, a.steps, port, path), nprocs=2, start_method="spawn")
        res = [torch.load(f"{path}.{r}", weights_only=False) for r in range(2)]

    by_stage = {r["rows"][0]["stage"]: r for r in res}
    step = [max(r0["step_s"], r1["step_s"]) for r0, r1 in zip(res[0]["rows"], res[1]["rows"])]
    step_min = [max(r0["step_min_s"], r1["step_min_s"]) for r0, r1 in zip(res[0]["rows"], res[1]["rows"])]
    for i, m in enumerate(ms):
        print(json.dumps({"bench": "pipeline_overhead_m", "m": m, "step_s": round(step[i], 6),
                          "step_min_s": round(step_min[i], 6),
                          "per_microbatch_s": round(step[i] / m, 6),
                          "busy_s_by_stage": [round(by_stage[s]["rows"][i]["busy_s"], 6) for s in (0, 1)],
                          "steps_s": [round(t, 6) for t in res[0]["rows"][i]["steps_s"]]}))
    a_fit, b_fit = _fit(ms, step)
    a_min, b_min = _fit(ms, step_min)
    busy_b = [_fit(ms, [row["busy_s"] for row in by_stage[s]["rows"]])[1] for s in (0, 1)]
    comp = next(r["compute"] for r in res if "compute" in r)
    stage_comp = [comp["stage0"], comp["stage1"]]
    rtt = statistics.fmean(r["rtt_s"] for r in res)
    rtt_min = min(r["rtt_min_s"] for r in res)
    critical = max((0, 1), key=lambda s: busy_b[s])
    resid = [step[i] - (a_fit + b_fit * m) for i, m in enumerate(ms)]
    print(json.dumps({
        "bench": "pipeline_overhead", "pp": 2, "dp": 1, "backend": "gloo", "precision": "fp32",
        "model": MODEL, "micro_batch": MICRO, "ms": ms,
        "per_microbatch_s": b_fit, "per_step_s": a_fit,
        "fit_max_abs_residual_s": max(abs(x) for x in resid),
        "engine_host_s_per_microbatch": b_fit - stage_comp[critical] - rtt,
        "engine_host_busy_s_per_microbatch_by_stage": [busy_b[s] - stage_comp[s] for s in (0, 1)],
        "busy_s_per_microbatch_by_stage": busy_b, "critical_stage": critical,
        "compute_s_per_microbatch": comp["whole"],
        "compute_s_per_microbatch_by_stage": stage_comp,
        "p2p_s_per_send": rtt / 2, "p2p_round_trip_s": rtt,
        "host": f"{host_platform.processor() or host_platform.machine()} x{os.cpu_count()}",
        "torch": torch.__version__, "deepspeed": importlib.import_module("deepspeed").__version__,
        "min_fit": {"per_microbatch_s": b_min, "per_step_s": a_min,
                    "engine_host_s_per_microbatch": b_min - comp[f"stage{critical}_min"] - rtt_min,
                    "compute_s_per_microbatch": comp["whole_min"],
                    "compute_s_per_microbatch_by_stage": [comp["stage0_min"], comp["stage1_min"]],
                    "p2p_s_per_send": rtt_min / 2},
        "load_avg": os.getloadavg(),
    }))


if __name__ == "__main__":
    main()
