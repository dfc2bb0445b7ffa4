"""Peak memory of one long sequence under selective checkpointing with the MLP recomputed whole and in tiles of rows
(model/parts/mlp.py MLP_TILE_BYTES), measured on CPU, beside the planner's prediction of the same quantity.

    python scripts/bench_mlp_tiles.py [--seq 16384]   # one JSON line per case (bench.py --only context_parallel)

One process, one thread: rayspeed's Transformer (fp32, 2 blocks, hidden 128, ffn 2048: the MLP's intermediates are
what a long sequence's backward rebuilds), a warm-up step on a short sequence, then one forward and backward of the
long one while a thread samples RSS (scripts/bench_context_parallel.py's Peak). `predicted_mib` is the planner's
activations + logits_loss + gradients of the same layout with the planner's tile size set alike.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import rayspeed  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "platform"))

MODEL = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4, ffn_hidden_size=2048, vocab_size=256)
WHOLE = 1 << 40  # a tile size no sequence here reaches: the MLP in one piece
MIB = 1 << 20


def _measure(seq: int, tile_bytes: int) -> tuple[float, float]:
    import torch

    from bench_context_parallel import Peak
    from rayspeed.model import transformer
    from rayspeed.model.parts import mlp

    mlp.MLP_TILE_BYTES = tile_bytes
    torch.set_num_threads(1)
    cfg = type("Cfg", (), {**MODEL, "seq_len": seq, "tie_embeddings": False})()
    model = transformer.Transformer(cfg, activation_checkpointing="selective", seed=1)
    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(0))
    model(ids[:, :64], ids[:, :64]).backward()
    model.zero_grad(set_to_none=True)
    peak = Peak()
    loss = model(ids, ids)
    loss.backward()
    return peak.stop() / MIB, float(loss.detach())


def _predicted(seq: int, tile_bytes: int) -> float:
    from rayspeed.config import parse
    from rayspeed.planner import memory
    from rayspeed.planner.plan import evaluate_layout

    memory.MLP_TILE_BYTES = tile_bytes
    cfg = parse({"name": "mlp-tiles", "model": {**MODEL, "seq_len": seq, "tie_embeddings": False},
                 "train": {"global_batch_size": 1, "precision": "fp32", "max_steps": 1}, "cluster": {"num_workers": 1}})
    p = evaluate_layout(cfg, {"dp": 1, "cp": 1, "tp": 1, "pp": 1, "zero_stage": 0, "micro_batch_size": 1,
                              "grad_accum": 1, "activation_checkpointing": "selective"}, world_size=1)
    b = p["memory_breakdown_gib"]
    return (b["activations"] + b["logits_loss"] + b["gradients"]) * 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--case", choices=("whole", "tiles"), help="one case in this process (the caller runs each apart)")
    a = ap.parse_args(argv)
    if a.case is None:  # each case in a fresh process: the allocator's state of one must not shape the other's peak
        import subprocess

        for case in ("whole", "tiles"):
            subprocess.run([sys.executable, __file__, "--seq", str(a.seq), "--case", case], check=True)
        return 0
    from rayspeed.model.transformer import MLP_TILE_BYTES

    tile = WHOLE if a.case == "whole" else MLP_TILE_BYTES
    measured, loss = _measure(a.seq, tile)
    predicted = _predicted(a.seq, tile)
    print(json.dumps({"bench": "mlp_tiles", "case": a.case, "seq_len": a.seq, "measured_mib": round(measured, 1),
                      "predicted_mib": round(predicted, 1), "ratio": round(measured / predicted, 3),
                      "loss": round(loss, 6)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
