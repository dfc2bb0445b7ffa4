"""What context parallelism costs beyond a shorter sequence per rank (docs/PLANNER.md, "Context parallelism").

The shorter sequence itself is in the block's terms (planner/model_math.py local_tokens: every token count is
seq_len / cp per rank; attention still sees all seq_len keys). What is added here is the exchange:
- Ulysses, per block and pass: an all-to-all of q, k and v into head-sharded form and one of the output back, each
  rank sending (cp - 1) / cp of its share. It sits between the projections and attention: nothing hides it.
- Ring: cp - 1 shifts of this rank's k and v around the cp group (their gradients go back the same way in backward).
  rayspeed's ring sends synchronously between blocks, so it is counted whole too.
Passes: forward, backward, and the recomputed forward under activation checkpointing.
"""

from __future__ import annotations

import math

from rayspeed.config.context_split import scheme_for
from rayspeed.planner.model_math import local_tokens
from rayspeed.planner.terms import TimeTerm, register


def _link(ctx, lay) -> tuple[float, float]:
    """(latency s, GB/s per rank) of the cp group: consecutive ranks after tp, so inside a node while tp x cp fits."""
    hw = ctx.hw
    across = lay.tp * lay.cp > ctx.node_size
    lat = (hw.inter_latency_us if across else hw.intra_latency_us) * 1e-6
    return lat, hw.inter_node_gbps if across else hw.intra_node_gbps


def exchange_s(ctx, lay) -> float:
    """Seconds per optimizer step of the cp exchange on one rank."""
    sh, cp = ctx.shape, lay.cp
    T = local_tokens(sh, lay)
    passes = 2 + (1 if lay.activation_checkpointing != "none" else 0)
    lat, gbps = _link(ctx, lay)
    kv_heads = sh.num_kv_heads // lay.tp
    if scheme_for(sh.num_heads, sh.num_kv_heads, lay.tp, cp, ctx.cp_scheme) == "ulysses":
        kv = max(kv_heads, cp) * sh.head_dim  # fewer kv heads than cp are repeated before the exchange
        nbytes = T * (2 * sh.q_dim / lay.tp + 2 * kv) * ctx.w_bytes
        per_block = 4 * lat + nbytes * (cp - 1) / cp / (gbps * 1e9)
    else:
        nbytes = T * 2 * kv_heads * sh.head_dim * ctx.w_bytes
        per_block = (cp - 1) * (2 * lat + nbytes / (gbps * 1e9))
    return lay.grad_accum * sh.num_layers * passes * per_block * ctx.comm_factor


def label_sum_s(ctx, lay) -> float:
    """The loss's divisor summed over the cp group once per micro-batch (a scalar all-reduce: latency only)."""
    lat, _ = _link(ctx, lay)
    return lay.grad_accum * 2 * math.ceil(math.log2(lay.cp)) * lat * ctx.comm_factor


register(TimeTerm("cp_exchange_s", applies=lambda ctx, lay: lay.cp > 1, seconds=exchange_s, kind="communication",
                  source="docs/PLANNER.md, Context parallelism: all-to-all and ring volumes per block"))
register(TimeTerm("cp_label_sum_s", applies=lambda ctx, lay: lay.cp > 1, seconds=label_sum_s, kind="communication",
                  source="docs/PLANNER.md, Context parallelism: the loss divisor's all-reduce"))
