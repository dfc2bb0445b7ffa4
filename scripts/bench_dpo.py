"""One DPO micro-batch, forward and backward, with the reference's log-probabilities precomputed (read from the
micro-batch) against a resident reference (one more forward, no backward, of a frozen copy): both step times, their
ratio next to what the planner assumes for the resident reference (planner/dpo_terms.py: one forward of a
micro-batch, a third of its forward + backward: ratio 4/3), the resident copy's bytes, and the largest difference
of the two losses (the same numbers, the reference scored now or before). One JSON line.

    PYTHONPATH=platform python scripts/bench_dpo.py [--hidden 256] [--layers 4] [--seq 256] [--pairs 4] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    from rayspeed.config.objective_keys import DpoConfig
    from rayspeed.config.shape import ModelShape
    from rayspeed.data.pair_batches import pair_batch
    from rayspeed.data.pairs import PairFile
    from rayspeed.model.transformer import Transformer
    from rayspeed.train.dpo_objective import DpoObjective

    torch.manual_seed(0)
    shape = ModelShape.from_config(SimpleNamespace(
        hidden_size=a.hidden, num_layers=a.layers, num_heads=8, num_kv_heads=8, ffn_hidden_size=4 * a.hidden,
        vocab_size=4096, seq_len=a.seq, tie_embeddings=False))
    policy, reference = Transformer(shape, seed=1), Transformer(shape, seed=1).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    rng = np.random.default_rng(0)
    lengths = [(a.seq // 4, a.seq // 2, a.seq // 2) for _ in range(a.pairs)]
    tokens = rng.integers(1, 4096, size=sum(map(sum, lengths))).astype(np.int32)
    offsets = np.cumsum([0] + [sum(x) for x in lengths[:-1]])
    pairs = PairFile(tokens, np.asarray([(o, *x) for o, x in zip(offsets, lengths)], dtype=np.int64), "bench", "h", 0)
    split = pairs.whole("train", a.seq)
    positions = np.arange(split.num_pairs)
    cfg = SimpleNamespace(train=SimpleNamespace(dpo=DpoConfig()), parallel=SimpleNamespace(grad_accum=1))
    groups, cpu = SimpleNamespace(dp=1, dp_group=None), torch.device("cpu")

    class Engine:
        module = policy

        def __call__(self, *args, **kw):
            return policy(*args, **kw)

    scorer = DpoObjective(cfg, groups, cpu)
    with torch.no_grad():
        ref = scorer.score(Engine(), split, list(positions), a.pairs).numpy()
    cases = {"precomputed": (DpoObjective(cfg, groups, cpu), pair_batch(split, positions, ref)),
             "resident": (DpoObjective(cfg, groups, cpu, resident=reference), pair_batch(split, positions, None))}
    times, losses = {}, {}
    for name, (objective, mb) in cases.items():
        runs = []
        for _ in range(a.reps + 1):  # the first is a warm-up
            policy.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = objective.train_loss(Engine(), mb)
            loss.backward()
            runs.append(time.perf_counter() - t0)
        times[name], losses[name] = statistics.median(runs[1:]), float(loss)
    copy_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    print(json.dumps({"bench": "dpo_reference", "pairs": a.pairs, "rows": 2 * a.pairs, "seq_len": a.seq,
                      "hidden": a.hidden, "layers": a.layers, "threads": torch.get_num_threads(),
                      "precomputed_step_s": round(times["precomputed"], 4),
                      "resident_step_s": round(times["resident"], 4),
                      "resident_over_precomputed": round(times["resident"] / times["precomputed"], 3),
                      "planner_assumes": round(4 / 3, 3), "resident_copy_mib": round(copy_bytes / 2**20, 1),
                      "max_loss_diff": abs(losses["resident"] - losses["precomputed"])}))


if __name__ == "__main__":
    main()
