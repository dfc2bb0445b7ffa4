"""Peak memory per rank of one long sequence at cp 1 and cp 2 (ulysses and ring), measured on CPU, beside the
planner's prediction of the same quantity.

    python scripts/bench_context_parallel.py [--seq 4096]   # one JSON line per case (bench.py --only context_parallel)

Two gloo ranks. Each case builds rayspeed's Transformer (fp32, no recomputation) and, after a warm-up step on a short
sequence and a baseline of the process's RSS, runs one forward and backward of the long sequence (a micro-batch of
one, packed documents off) while a thread samples RSS every 2 ms: `measured_mib` is the peak above the baseline on
the rank with the larger one. At cp 1 rank 0 runs the whole sequence alone. Large tensors are kept as their own
mappings (MALLOC_MMAP_THRESHOLD_, set by the caller) so freed memory leaves RSS and the peak is the step's own.
`predicted_mib` is the planner's activations + logits_loss + gradients of the same layout
(rayspeed.planner.plan.evaluate_layout, cluster.gpu cpu): what grows with the sequence, plus the gradients that
backward allocates.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import rayspeed  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "platform"))

MODEL = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, ffn_hidden_size=512, vocab_size=256)
CASES = (("cp1", 1, "ulysses"), ("cp2-ulysses", 2, "ulysses"), ("cp2-ring", 2, "ring"))
MIB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    def __init__(self):
        self.base, self.peak, self._stop = _rss(), 0, False
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self):
        while not self._stop:
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def stop(self) -> int:
        self._stop = True
        self._t.join()
        return max(self.peak, _rss()) - self.base


def _world(rank, world_size, seq, names=None):
    import torch
    import torch.distributed as dist

    from rayspeed.model import Transformer
    from rayspeed.parallel.context_parallel import NO_CP, ContextParallel, shard

    torch.set_num_threads(1)
    group = dist.new_group([0, 1])
    cfg = type("Cfg", (), {**MODEL, "seq_len": seq, "tie_embeddings": False})()
    out = {}
    for name, cp, scheme in CASES:
        if names and name not in names:
            continue
        dist.barrier()
        active = cp > 1 or rank == 0
        if active:
            ctx = ContextParallel.from_ranks(group, [0, 1], scheme) if cp > 1 else NO_CP
            model = Transformer(cfg, seed=1, cp=ctx)
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, 256, (1, seq), generator=g)
            labels = torch.randint(0, 256, (1, seq), generator=g)
            warm = 16 * cp
            model(shard(ids[:, :warm], ctx), shard(labels[:, :warm], ctx)).backward()
            model.zero_grad(set_to_none=True)
            peak = Peak()
            model(shard(ids, ctx), shard(labels, ctx)).backward()
            out[name] = peak.stop()
            del model
        dist.barrier()
    return out


def _predicted(seq: int, cp: int, scheme: str) -> float:
    from rayspeed.config import parse
    from rayspeed.planner.plan import evaluate_layout

    cfg = parse({"name": "cp-bench", "model": {**MODEL, "seq_len": seq},
                 "train": {"global_batch_size": 1, "precision": "fp32", "max_steps": 1},
                 "parallel": {"cp_scheme": scheme}, "cluster": {"num_workers": cp}})
    p = evaluate_layout(cfg, {"dp": 1, "cp": cp, "tp": 1, "pp": 1, "zero_stage": 0, "micro_batch_size": 1,
                              "grad_accum": 1, "activation_checkpointing": "none"}, world_size=cp)
    b = p["memory_breakdown_gib"]
    return (b["activations"] + b["logits_loss"] + b["gradients"]) * 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES), help="comma-separated case names")
    a = ap.parse_args(argv)
    names = [n for n in a.cases.split(",") if n]
    sys.path.insert(0, str(ROOT / "tests"))
    from _dist import run_distributed

    per_rank = run_distributed(_world, 2, a.seq, names, timeout_s=900)
    for name, cp, scheme in CASES:
        if name not in names:
            continue
        measured = max(r.get(name, 0) for r in per_rank) / MIB
        predicted = _predicted(a.seq, cp, scheme)
        print(json.dumps({"bench": "context_parallel", "case": name, "seq_len": a.seq, "cp": cp, "scheme": scheme,
                          "measured_mib": round(measured, 1), "predicted_mib": round(predicted, 1),
                          "ratio": round(measured / predicted, 3) if predicted else None}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
