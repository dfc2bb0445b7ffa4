"""Peak memory per pipeline stage under DeepSpeed's 1F1B schedule, measured on CPU, beside the planner's prediction.

    python scripts/bench_pipeline_memory.py [--pp 4] [--ms 1,2,4,8] [--seq 1024] [--layers 2] [--ckpt none]
                                            # bench.py --only pipeline_memory

pp gloo ranks (dp 1), fp32, ZeRO-0, a micro-batch of one sequence, `--layers` blocks per stage. For each number of
micro-batches m a fresh engine goes through the platform's own path (rayspeed.config.parse -> engine.deepspeed_config ->
engine.build.build_engine -> DeepSpeed's PipelineEngine running its TrainSchedule), takes one warm-up step, then
one more step while a thread samples the process's RSS every 2 ms: `measured_mib` per stage is the peak above the
RSS just before that step. Large tensors are kept as their own mappings (MALLOC_MMAP_THRESHOLD_, set by the
caller) so what is freed leaves RSS and the peak is the step's own.

`predicted_mib` per stage is what the planner says the step allocates (planner.memory.stage_breakdown of the same
layout, cluster.gpu cpu): activations + logits_loss, plus the gradients when the engine frees them between steps
(`gradients_kept_between_steps` says), less the pipeline buffers that outlive a step (in the baseline). The planner
holds min(pp - stage, m) micro-batches in flight on a stage (1F1B's warm-up), plus the engine's input/output
buffers; the measurement says whether the first stages of a deep pipeline really keep that many.
`measured_mib - measured at m=1` against the same difference of the predictions takes out what does not depend
on m (the per-step constants of the engine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import rayspeed  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "platform"))

MODEL = dict(hidden_size=256, num_heads=8, num_kv_heads=4, ffn_hidden_size=512, vocab_size=256, tie_embeddings=False)
MIB = 1 << 20


def job_cfg(pp: int, m: int, seq: int, layers: int, ckpt: str):
    from rayspeed.config import parse

    return parse({
        "name": "pipemem", "model": {**MODEL, "num_layers": pp * layers, "seq_len": seq},
        "train": {"global_batch_size": m, "precision": "fp32", "max_steps": 10, "warmup_steps": 0, "lr": 1e-3},
        "parallel": dict(dp=1, tp=1, pp=pp, zero_stage=0, micro_batch_size=1, grad_accum=m,
                         sequence_parallel=False, activation_checkpointing=ckpt,
                         stage_layers=[layers] * pp),
        "cluster": {"num_workers": pp},
    })


def _world(rank, world_size, ms, seq, layers, ckpt):
    import gc
    import logging

    import deepspeed
    import torch
    import torch.distributed as dist

    from rayspeed import compat

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    compat.skip_deepspeed_shm_comm_op()  # as the platform's CPU workers do
    deepspeed.init_distributed(dist_backend="gloo")
    from bench_context_parallel import Peak  # the same RSS sampler as the cp and MLP-tile benches
    from rayspeed.engine.build import build_engine
    from rayspeed.engine.deepspeed_config import deepspeed_config
    from rayspeed.parallel.groups import ParallelGroups

    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, MODEL["vocab_size"], (1, seq), generator=g),
             torch.randint(0, MODEL["vocab_size"], (1, seq), generator=g))
    out = {}
    for m in ms:
        cfg = job_cfg(world_size, m, seq, layers, ckpt)
        engine, pipelined = build_engine(cfg, deepspeed_config(cfg), ParallelGroups(1, 1, world_size),
                                         torch.device("cpu"))
        assert pipelined and engine.micro_batches == m
        data = iter(lambda: batch, None)  # endless: the same micro-batch
        engine.train_batch(data_iter=data)
        gc.collect()
        # Gradients the engine keeps between steps are in the baseline; freed ones are allocated again in the step.
        kept = sum(p.grad.numel() * p.grad.element_size() for p in engine.module.parameters() if p.grad is not None)
        dist.barrier()
        peak = Peak()
        engine.train_batch(data_iter=data)
        out[m] = {"stage": engine.stage_id, "measured": peak.stop(), "grads_kept": kept > 0}
        del engine
        gc.collect()
        dist.barrier()
    return out


def predicted_mib(pp: int, m: int, seq: int, layers: int, ckpt: str, grads_kept: list[bool]) -> list[float]:
    """Per stage, what the planner says one step allocates above the baseline: activations + logits_loss, the
    gradients when the engine frees them between steps, less the pipeline buffers that outlive a step (the receive
    buffer of stages > 0 and the last stage's two kept outputs, memory.activation_bytes' `pipe` term): those are in
    the baseline."""
    from rayspeed.config.layout import Layout
    from rayspeed.planner.memory import stage_breakdown
    from rayspeed.planner.search import build_ctx

    ctx = build_ctx(job_cfg(pp, m, seq, layers, ckpt), pp)
    lay = Layout(dp=1, tp=1, pp=pp, zero_stage=0, micro_batch_size=1, grad_accum=m, activation_checkpointing=ckpt,
                 stage_layers=(layers,) * pp)
    hidden_state = seq * MODEL["hidden_size"] * 4  # fp32, one micro-batch of one sequence
    out = []
    for st in range(pp):
        b = stage_breakdown(ctx, lay, st)
        persistent = ((1 if st > 0 else 0) + (2 if st == pp - 1 else 0)) * hidden_state
        grads = 0.0 if grads_kept[st] else b["gradients"]
        out.append((b["activations"] + b["logits_loss"] + grads - persistent) / MIB)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--ms", default="1,2,4,8")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2, help="transformer blocks per stage")
    ap.add_argument("--ckpt", default="none", choices=("none", "selective", "full"))
    a = ap.parse_args(argv)
    ms = [int(x) for x in a.ms.split(",")]
    sys.path.insert(0, str(ROOT / "tests"))
    from _dist import run_distributed

    per_rank = run_distributed(_world, a.pp, ms, a.seq, a.layers, a.ckpt, timeout_s=600)
    from rayspeed.config.layout import Layout
    from rayspeed.planner.memory import micro_batches_in_flight

    first = {}
    for m in ms:
        lay = Layout(dp=1, tp=1, pp=a.pp, zero_stage=0, micro_batch_size=1, grad_accum=m)
        by_stage = {r[m]["stage"]: r[m] for r in per_rank}
        meas = [by_stage[s]["measured"] / MIB for s in range(a.pp)]
        kept = [by_stage[s]["grads_kept"] for s in range(a.pp)]
        pred = predicted_mib(a.pp, m, a.seq, a.layers, a.ckpt, kept)
        first.setdefault("meas", meas)
        first.setdefault("pred", pred)
        print(json.dumps({
            "bench": "pipeline_memory", "pp": a.pp, "m": m, "seq_len": a.seq, "micro_batch": 1,
            "layers_per_stage": a.layers, "activation_checkpointing": a.ckpt, "hidden": MODEL["hidden_size"],
            "precision": "fp32",
            "in_flight_predicted": [micro_batches_in_flight(lay, s) for s in range(a.pp)],
            "gradients_kept_between_steps": kept,
            "measured_mib": [round(x, 1) for x in meas], "predicted_mib": [round(x, 1) for x in pred],
            "ratio": [round(x / y, 3) if y else None for x, y in zip(meas, pred)],
            "growth_over_m1_measured_mib": [round(x - y, 1) for x, y in zip(meas, first["meas"])],
            "growth_over_m1_predicted_mib": [round(x - y, 1) for x, y in zip(pred, first["pred"])],
            "load_avg": [round(x, 2) for x in os.getloadavg()],
        }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
