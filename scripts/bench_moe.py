"""One mixture-of-experts layer, forward and backward, with its experts run as grouped matrix products (rayspeed's
layer, rayspeed.model.moe.MoE) against a Python loop over the experts (what a dense path does: one expert's rows,
three matmuls, then the next expert) on the same weights and tokens; one JSON line with both step times, their
ratio and the largest difference of the outputs and of the gradients (the same result, by another summation order).

    PYTHONPATH=platform python scripts/bench_moe.py [--tokens 2048] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F


def loop_experts(moe, x: torch.Tensor) -> torch.Tensor:
    """The reference: every expert in turn over the rows routed to it."""
    flat = x.reshape(-1, x.shape[-1])
    weights, experts = moe.route(flat)
    out = torch.zeros_like(flat)
    for e in range(moe.num_experts):
        token, slot = torch.where(experts == e)
        if token.numel() == 0:
            continue
        rows = flat[token]
        h = F.silu(rows @ moe.w_gate[e].t()) * (rows @ moe.w_up[e].t())
        out = out.index_add(0, token, (h @ moe.w_down[e].t()) * weights[token, slot].unsqueeze(-1))
    return out.reshape(x.shape)


def timed(fn, reps: int) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
    times, out, grads = [], None, []
    for _ in range(reps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        out, grads = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), out, grads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-ffn", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    from rayspeed.config.shape import ModelShape
    from rayspeed.model.moe import MoE

    torch.manual_seed(0)
    shape = ModelShape.from_config(SimpleNamespace(
        architecture="Qwen3MoeForCausalLM", hidden_size=a.hidden, num_layers=1, num_heads=8, num_kv_heads=8,
        head_dim=a.hidden // 8, ffn_hidden_size=4 * a.hidden, vocab_size=256, seq_len=a.tokens, tie_embeddings=False,
        num_experts=a.experts, experts_per_token=a.top_k, expert_ffn_hidden_size=a.expert_ffn))
    moe = MoE(shape, seed=1, name="layers.0.mlp")
    x = torch.randn(1, a.tokens, a.hidden)

    def step(forward):
        def run():
            moe.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            out = forward(xi)
            out.square().mean().backward()
            return out.detach(), [xi.grad] + [p.grad for p in (moe.w_gate, moe.w_up, moe.w_down, moe.router.weight)]
        return run

    grouped_s, grouped_out, grouped_grads = timed(step(moe), a.reps)
    loop_s, loop_out, loop_grads = timed(step(lambda xi: loop_experts(moe, xi)), a.reps)
    diff = max([float((grouped_out - loop_out).abs().max())]
               + [float((g - r).abs().max()) for g, r in zip(grouped_grads, loop_grads)])
    print(json.dumps({
        "bench": "moe_experts", "tokens": a.tokens, "hidden": a.hidden, "experts": a.experts, "top_k": a.top_k,
        "expert_ffn": a.expert_ffn, "threads": torch.get_num_threads(), "reps": a.reps,
        "grouped_ms": round(grouped_s * 1e3, 2), "loop_ms": round(loop_s * 1e3, 2),
        "loop_over_grouped": round(loop_s / grouped_s, 2), "max_abs_diff": diff}))


if __name__ == "__main__":
    main()
