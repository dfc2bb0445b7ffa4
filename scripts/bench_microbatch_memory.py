"""Peak memory of one training step as the micro-batch grows, measured on CPU, beside the planner's prediction.

    python scripts/bench_microbatch_memory.py [--mbs 1,2,4,8,16] [--seq 256] [--layers 4] [--ckpt none]
                                              # bench.py --only memory_errors

One gloo rank (dp 1, pp 1), fp32, ZeRO-0, the platform's own path (rayspeed.config.parse -> engine.deepspeed_config
-> engine.build.build_engine), `--layers` blocks of hidden 256. For each micro-batch size a fresh engine takes one
warm-up step, then one more while a thread samples the process's RSS every 2 ms: `measured_mib` is the peak above
the RSS just before that step (large tensors are their own mappings, MALLOC_MMAP_THRESHOLD_ set by the caller, so
what is freed leaves RSS). `predicted_mib` is what the planner says that step allocates (planner.memory's
stage_breakdown of the same layout, cluster.gpu cpu): activations + logits_loss, plus the gradients when the engine
frees them between steps. The pipeline's counterpart is scripts/bench_pipeline_memory.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from bench_pipeline_memory import MIB, MODEL, ROOT  # the pipeline bench's model (and its rayspeed import path)


def job_cfg(mb: int, seq: int, layers: int, ckpt: str):
    from rayspeed.config import parse

    return parse({
        "name": "mbmem", "model": {**MODEL, "num_layers": layers, "seq_len": seq},
        "train": {"global_batch_size": mb, "precision": "fp32", "max_steps": 10, "warmup_steps": 0, "lr": 1e-3},
        "parallel": dict(dp=1, tp=1, pp=1, zero_stage=0, micro_batch_size=mb, grad_accum=1,
                         sequence_parallel=False, activation_checkpointing=ckpt),
        "cluster": {"num_workers": 1},
    })


def _world(rank, world_size, mbs, seq, layers, ckpt):
    import gc
    import logging

    import deepspeed
    import torch

    from rayspeed import compat

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    compat.skip_deepspeed_shm_comm_op()  # as the platform's CPU workers do
    deepspeed.init_distributed(dist_backend="gloo")
    from bench_context_parallel import Peak  # the same RSS sampler as the pipeline, cp and MLP-tile benches
    from rayspeed.engine.build import build_engine
    from rayspeed.engine.deepspeed_config import deepspeed_config
    from rayspeed.parallel.groups import ParallelGroups

    out = {}
    for mb in mbs:
        g = torch.Generator().manual_seed(mb)
        x = torch.randint(0, MODEL["vocab_size"], (mb, seq), generator=g)
        y = torch.randint(0, MODEL["vocab_size"], (mb, seq), generator=g)
        cfg = job_cfg(mb, seq, layers, ckpt)
        engine, pipelined = build_engine(cfg, deepspeed_config(cfg), ParallelGroups(1, 1, 1), torch.device("cpu"))
        assert not pipelined
        _step(engine, x, y)
        gc.collect()
        # Gradients the engine keeps between steps are in the baseline; freed ones are allocated again in the step.
        kept = sum(p.grad.numel() * p.grad.element_size() for p in engine.module.parameters() if p.grad is not None)
        peak = Peak()
        _step(engine, x, y)
        out[mb] = {"measured": peak.stop(), "grads_kept": kept > 0}
        del engine
        gc.collect()
    return out


def _step(engine, x, y) -> None:
    engine.backward(engine(x, y))
    engine.step()


def predicted_mib(mb: int, seq: int, layers: int, ckpt: str, grads_kept: bool) -> float:
    """What the planner says one step allocates above the baseline: activations + logits_loss, and the gradients
    when the engine frees them between steps."""
    from rayspeed.config.layout import Layout
    from rayspeed.planner.memory import stage_breakdown
    from rayspeed.planner.search import build_ctx

    ctx = build_ctx(job_cfg(mb, seq, layers, ckpt), 1)
    lay = Layout(dp=1, tp=1, pp=1, zero_stage=0, micro_batch_size=mb, grad_accum=1, activation_checkpointing=ckpt)
    b = stage_breakdown(ctx, lay, 0)
    return (b["activations"] + b["logits_loss"] + (0.0 if grads_kept else b["gradients"])) / MIB


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbs", default="1,2,4,8,16")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ckpt", default="none", choices=("none", "selective", "full"))
    a = ap.parse_args(argv)
    mbs = [int(x) for x in a.mbs.split(",")]
    sys.path.insert(0, str(ROOT / "tests"))
    from _dist import run_distributed

    (res,) = run_distributed(_world, 1, mbs, a.seq, a.layers, a.ckpt, timeout_s=600)
    for mb in mbs:
        meas = res[mb]["measured"] / MIB
        pred = predicted_mib(mb, a.seq, a.layers, a.ckpt, res[mb]["grads_kept"])
        print(json.dumps({
            "bench": "microbatch_memory", "micro_batch": mb, "seq_len": a.seq, "layers": a.layers,
            "activation_checkpointing": a.ckpt, "hidden": MODEL["hidden_size"], "precision": "fp32",
            "gradients_kept_between_steps": res[mb]["grads_kept"],
            "measured_mib": round(meas, 1), "predicted_mib": round(pred, 1), "ratio": round(meas / pred, 3),
            "load_avg": [round(x, 2) for x in os.getloadavg()],
        }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
