"""Masked and soft-capped attention through SDPA (dense mask; the math path for a cap) and FlexAttention (block mask,
score modifier), side by side: time per forward + backward and peak memory on CUDA, the same output.

    python scripts/bench_attention_kernels.py                  # on a GPU: bf16, one JSON line per case and kernel
    python scripts/bench_attention_kernels.py --device cpu     # dry run: a short sequence, forward only, fp32

The cases are what model.attention_kernel decides: a sliding window shorter than the sequence (Mistral, Gemma's
local layers), packed documents, and Gemma 2's soft-capped scores with a window. Run on the lent GPU with
scripts/bench_gpu.py; docs/BENCHMARKS.md records it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import rayspeed  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "platform"))


def main(argv=None) -> int:
    import torch

    from rayspeed.model.attention import MaskRows, masked_attention
    from rayspeed.model.flex import flex_attention

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--seq", type=int, default=None, help="default: 16384 on cuda, 512 on cpu")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    s = a.seq or (16384 if cuda else 512)
    dtype = torch.bfloat16 if cuda else torch.float32
    heads, kv, d = 32, 8, 128
    seg = torch.zeros(1, s, dtype=torch.long, device=a.device)
    for start in range(s // 4, s, s // 4):
        seg[0, start:] += 1  # four packed documents
    cases = {"window": (MaskRows.of(s, None, s // 4, a.device), None),
             "documents": (MaskRows.of(s, seg, None, a.device), None),
             "softcap_window": (MaskRows.of(s, None, s // 4, a.device), 50.0)}
    g = torch.Generator(device=a.device).manual_seed(0)
    q = torch.randn(1, heads, s, d, device=a.device, dtype=dtype, generator=g)
    k = torch.randn(1, kv, s, d, device=a.device, dtype=dtype, generator=g)
    v = torch.randn(1, kv, s, d, device=a.device, dtype=dtype, generator=g)
    for case, (rows, cap) in cases.items():
        outs = {}
        for kernel, fn in (("sdpa", masked_attention), ("flex", flex_attention)):
            qq, kk, vv = (t.detach().requires_grad_(cuda) for t in (q, k, v))
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(a.reps + 1):
                start = time.perf_counter()
                with torch.set_grad_enabled(cuda):
                    out = fn(qq, kk, vv, rows, None, cap)
                    if cuda:
                        out.float().sum().backward()
                        torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            outs[kernel] = out.detach().float()
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
            print(json.dumps({"bench": "attention_kernels", "case": case, "kernel": kernel, "seq_len": s,
                              "device": a.device, "ms": round(1e3 * sorted(times[1:])[len(times[1:]) // 2], 3),
                              "peak_gib": round(peak, 3) if peak is not None else None,
                              "what": "forward+backward" if cuda else "forward"}), flush=True)
        diff = float((outs["flex"] - outs["sdpa"]).abs().max())
        print(json.dumps({"bench": "attention_kernels", "case": case, "max_abs_diff": diff}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
