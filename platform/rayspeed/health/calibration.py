"""What `rayspeed calibrate` measures on each rank, beside the healthcheck's all-reduce/all-gather sweeps (it runs
inside the healthcheck's ranks: same placement group, same process group, same environment profile).

    measure_rank(rank, world, device, spec) -> {gemm, op_overhead_us, attention_flops, reducescatter, p2p, engine}

- gemm: FLOP/s of the GEMMs the job's candidate layouts would run (spec["gemm_shapes"], the job's dtype).
Every figure is a median over repetitions (what a job on this machine meets), not the best run.
- op_overhead_us: host time of one tiny eager op (what bounds small models).
- cpu_share (CPU ranks): the fraction of a core a rank gets over a long busy stretch on a shared machine.
- attention_flops: causal SDPA forward + backward at the job's per-rank shape, in the FLOPs the planner counts.
- reducescatter: the third collective of the time model, swept like the other two.
- p2p: one rank to the next (a pipeline send), at a small and a large message.
- model: the real engine (the job's ZeRO stage) on the job's own model at its width, sequence and a candidate
  micro-batch, at two depths: the real block and head against the sum of their parts.
- engine: the real engine (rayspeed.engine.build, DeepSpeed, the job's ZeRO stage and precision) on a narrow
  stand-in of the job's model at two depths, forward, backward and step timed apart: the per-block host time,
  the fixed time per micro-batch and the optimizer step's engine time, with negligible math.
- pipeline (an even number of ranks): the narrow stand-in at 2 blocks through DeepSpeed's pipeline engine (pp 2,
  ZeRO-1), a step at two micro-batch counts: the engine's seconds per micro-batch (planner
  hardware.pipe_host_mb_us once the stand-in's own work per micro-batch is taken off).
Collective: every rank calls it with the same spec.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

STANDIN_DEPTHS = (1, 3)
STANDIN_SEQ = 16


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _dtype(precision: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def _typical_s(fn, dev: torch.device, reps: int) -> float:
    """Median seconds of `reps` runs after one warm-up: what a job sharing this machine meets, where the best run
    would be what the device does alone (the same on a dedicated GPU, not on shared CPU cores)."""
    fn()
    _sync(dev)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_table(shapes: list[list[int]], dev: torch.device, dtype: torch.dtype,
               budget_s: float = 10.0) -> list[list[float]]:
    """[[m, k, n, flop_per_s], ...] for each shape, best of a few repetitions (bounded by budget_s in all)."""
    out = []
    t_end = time.perf_counter() + budget_s
    for m, k, n in shapes:
        if time.perf_counter() > t_end:
            break
        a = torch.randn(int(m), int(k), device=dev, dtype=dtype)
        b = torch.randn(int(k), int(n), device=dev, dtype=dtype)
        reps = 10 if dev.type == "cuda" else 5
        sec = _typical_s(lambda a=a, b=b: torch.mm(a, b), dev, reps)
        out.append([int(m), int(k), int(n), 2.0 * m * k * n / max(sec, 1e-12)])
        del a, b
    return out


def op_overhead_us(dev: torch.device, n: int = 2000) -> float:
    """Host time per tiny eager op (queued back to back, like a model's element-wise ops)."""
    x = torch.ones(8, device=dev)
    y = torch.ones(8, device=dev)
    for _ in range(50):
        torch.add(x, y, out=x)
    _sync(dev)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            torch.add(x, y, out=x)
        _sync(dev)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times) * 1e6


def attention_flops(dev: torch.device, dtype: torch.dtype, batch: int, heads: int, seq: int, head_dim: int) -> float:
    """FLOP/s of causal SDPA forward + backward, counted as the planner counts them (2.T.s.h forward, 2.5x that
    backward, T = batch x seq, h = heads x head_dim)."""
    import torch.nn.functional as F

    q = torch.randn(batch, heads, seq, head_dim, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    v = torch.randn_like(q, requires_grad=True)

    def run():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.sum().backward()

    sec = _typical_s(run, dev, 5)
    flops = 3.5 * 2.0 * batch * seq * seq * heads * head_dim
    return flops / max(sec, 1e-12)


def _standin(cfg, layers: int, world: int, zero: int, mb: int | None = None):
    """The job at `layers` blocks, pure data parallel over the calibration ranks: at a narrow width with one short
    sequence (mb None: the engine's host time, negligible math), or at the job's own width, sequence and
    micro-batch `mb` (the real block through the real engine)."""
    m = cfg.model
    if mb is None:
        gqa = (m.num_kv_heads or m.num_heads) < m.num_heads
        model = dataclasses.replace(m, hidden_size=64, num_layers=layers, num_heads=4, num_kv_heads=2 if gqa else 4,
                                    ffn_hidden_size=128, vocab_size=256, seq_len=STANDIN_SEQ)
    else:
        model = dataclasses.replace(m, num_layers=layers)
    par = dataclasses.replace(cfg.parallel, dp=world, tp=1, pp=1, micro_batch_size=mb or 1, grad_accum=1,
                              sequence_parallel=False, zero_stage=zero)
    if hasattr(par, "stage_layers"):
        par = dataclasses.replace(par, stage_layers=None)
    train = dataclasses.replace(cfg.train, global_batch_size=world * (mb or 1), compile=False, init_from=None)
    return dataclasses.replace(cfg, model=model, parallel=par, train=train)


def engine_times(job: dict, dev: torch.device, world: int, zero_stages=(0, 1, 2, 3), reps: int = 15,
                 warmup: int = 3, mb: int | None = None, depths=STANDIN_DEPTHS) -> dict:
    """Per ZeRO stage, median forward / backward / step seconds of the real engine on the stand-in at each depth
    (narrow, or at the job's width with micro-batch `mb`)."""
    import deepspeed

    from rayspeed.compat import skip_deepspeed_shm_comm_op
    from rayspeed.config.load import parse
    from rayspeed.engine.build import build_engine
    from rayspeed.engine.clip import GradClipper
    from rayspeed.engine.deepspeed_config import deepspeed_config, rayspeed_clips
    from rayspeed.parallel.groups import ParallelGroups

    if dev.type != "cuda":
        skip_deepspeed_shm_comm_op()
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    cfg = parse(job)
    groups = ParallelGroups(world, 1, 1)
    out: dict[str, Any] = {}
    for zero in zero_stages:
        res: dict[str, Any] = {"depths": list(depths), "mb": mb, "fwd_s": [], "bwd_s": [], "step_s": []}
        for layers in depths:
            c = _standin(cfg, layers, world, zero, mb)
            engine, _ = build_engine(c, deepspeed_config(c, None), groups, dev)
            clipper = (GradClipper(engine.module.parameters(), c.train.grad_clip, groups.tp_group)
                       if rayspeed_clips(c) else None)
            x = torch.randint(0, c.model.vocab_size, (c.parallel.micro_batch_size, c.model.seq_len), device=dev)
            f, b, s = [], [], []
            for i in range(warmup + reps):
                t0 = time.perf_counter()
                loss = engine(x, x)
                _sync(dev)
                t1 = time.perf_counter()
                engine.backward(loss)
                _sync(dev)
                t2 = time.perf_counter()
                if clipper is not None:
                    clipper()
                engine.step()
                _sync(dev)
                t3 = time.perf_counter()
                if i >= warmup:
                    f.append(t1 - t0)
                    b.append(t2 - t1)
                    s.append(t3 - t2)
            res["fwd_s"].append(statistics.median(f))
            res["bwd_s"].append(statistics.median(b))
            res["step_s"].append(statistics.median(s))
            del engine
        out[str(zero)] = res
    return out


PIPE_MICRO_BATCHES = (2, 8)


def pipeline_times(job: dict, dev: torch.device, world: int, ms=PIPE_MICRO_BATCHES, reps: int = 5,
                   warmup: int = 2) -> dict:
    """Median step seconds of DeepSpeed's pipeline engine (pp 2 over the calibration ranks, ZeRO-1) on the narrow
    stand-in at 2 blocks, micro-batch 1, for each micro-batch count in `ms`. Collective."""
    from rayspeed.config.load import parse
    from rayspeed.engine.build import build_engine
    from rayspeed.engine.deepspeed_config import deepspeed_config
    from rayspeed.parallel.groups import ParallelGroups

    base = _standin(parse(job), 2, world, 1)
    groups = ParallelGroups(world // 2, 1, 2)
    out: dict[str, Any] = {"ms": list(ms), "step_s": []}
    for m in ms:
        par = dataclasses.replace(base.parallel, dp=world // 2, pp=2, grad_accum=m)
        train = dataclasses.replace(base.train, global_batch_size=world // 2 * m)
        c = dataclasses.replace(base, parallel=par, train=train)
        engine, pipelined = build_engine(c, deepspeed_config(c, None), groups, dev)
        if not pipelined:
            return {}
        x = torch.randint(0, c.model.vocab_size, (1, c.model.seq_len), device=dev)
        data = iter(lambda: (x, x), None)  # endless: the same micro-batch
        times = []
        for i in range(warmup + reps):
            dist.barrier()
            t0 = time.perf_counter()
            engine.train_batch(data_iter=data)
            _sync(dev)
            dist.barrier()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        out["step_s"].append(statistics.median(times))
        del engine
    return out


def cpu_share(seconds: float = 1.5) -> float:
    """Fraction of a core this thread gets while busy: its CPU time over the wall time of a busy loop of small
    tensor ops (every rank runs it at once, as they train). Short measurements elsewhere see an idle core;
    a training step spans many scheduler periods and gets only its share."""
    a = torch.randn(64, 64)
    t0, c0 = time.perf_counter(), time.thread_time()
    while time.perf_counter() - t0 < seconds:
        for _ in range(50):
            torch.mm(a, a)
    return min(1.0, (time.thread_time() - c0) / max(time.perf_counter() - t0, 1e-9))


def measure_rank(rank: int, world: int, device: torch.device, spec: dict) -> dict:
    from rayspeed.health import collectives

    os.environ.setdefault("LOCAL_RANK", str(spec.get("local_rank", 0)))
    dtype = _dtype(spec.get("precision", "fp32"))
    out: dict[str, Any] = {"rank": rank}
    if device.type != "cuda":
        dist.barrier()  # every rank busy at once, as in training
        out["cpu_share"] = cpu_share()
    t0 = time.perf_counter()
    out["gemm"] = gemm_table(spec.get("gemm_shapes", []), device, dtype)
    out["op_overhead_us"] = op_overhead_us(device)
    att = spec.get("attention")
    if att:
        out["attention_flops"] = attention_flops(device, dtype, *att)
    out["local_s"] = round(time.perf_counter() - t0, 3)
    sizes, iters, warmup = spec.get("sizes"), spec.get("iters"), spec.get("warmup")
    out["reducescatter"] = collectives.reducescatter_sweep(None, sizes, device, iters, warmup)
    if world > 1:
        out["p2p"] = [{"bytes": nb, "gbps": collectives.ring_sendrecv(None, nb, device, iters=5)}
                      for nb in spec.get("p2p_bytes", [4096, 4 << 20])]
    if spec.get("job"):
        t1 = time.perf_counter()
        out["engine"] = engine_times(spec["job"], device, world)
        if spec.get("model_mb"):  # the real block at the job's width, through the job's own engine
            zero = str(spec["job"]["parallel"]["zero_stage"])
            out["model"] = engine_times(spec["job"], device, world, zero_stages=(int(zero),), reps=9, warmup=2,
                                        mb=int(spec["model_mb"]), depths=(1, 2))[zero]
        if world >= 2 and world % 2 == 0:
            out["pipeline"] = pipeline_times(spec["job"], device, world)
        out["engine_s"] = round(time.perf_counter() - t1, 3)
    return out


def device_peak_memory_gib(device: Any) -> float | None:
    """Peak device memory of this process on a GPU: the caching allocator's peak reservation plus what lives
    outside it now (CUDA context, cuBLAS workspaces, NCCL buffers: device used - reserved). None on CPU."""
    if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    outside = max(0, (total - free) - reserved)
    return (torch.cuda.max_memory_reserved(device) + outside) / 2**30


def worst_rank_peak_memory_gib(device: Any) -> float | None:
    """The largest `device_peak_memory_gib` over all ranks (a collective on GPUs); None on CPU without one."""
    mine = device_peak_memory_gib(device)
    if mine is None:
        return None
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([mine], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        mine = float(t.item())
    return mine
