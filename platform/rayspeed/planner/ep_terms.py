"""What a mixture of experts computes, and what expert parallelism costs and saves (docs/PLANNER.md, "Expert
parallelism").

Computes (every layout): per MoE layer the router (h x E) and, per expert, T x top-k / E rows on average (evenly
routed) through gate/up and down: thinner GEMMs than a dense MLP's (mlp_gemm_s), and SwiGLU over top-k experts'
widths (swiglu_width).

Saves: a rank holds 1 / ep of each MoE layer's experts (planner/model_math.py stage_params), so their weights,
gradients and optimizer state shrink by ep; ZeRO then partitions over the dp / ep ranks holding the same experts
(Layout.zero_ranks), which makes the weights every rank holds alike (attention, norms, embeddings, routers) a
larger share per rank.
Costs, both exposed (nothing overlaps them in rayspeed's layer):
- per MoE layer and pass, two all-to-alls (tokens to their experts' ranks, results back), each rank sending
  (ep - 1) / ep of its top-k rows of hidden size h (evenly routed tokens: imbalance makes the busiest rank wait);
  passes are forward, backward and the recomputed forward under activation checkpointing;
- the weights every ep rank holds alike average their gradients over the ep group as they accumulate, once per
  micro-batch (rayspeed.parallel.expert_parallel.average_over_ep): an all-reduce of those gradients.
The ep group is ep consecutive data-parallel ranks, strided by tp x cp: inside a node while ep x tp x cp fits.
"""

from __future__ import annotations

from rayspeed.planner.model_math import local_tokens, stage_params
from rayspeed.planner.terms import TimeTerm, register


def mlp_gemm_s(ctx, T: float, dense_s: float, gemm_s, tp: int = 1) -> float:
    """One block's MLP GEMMs forward for T tokens, averaged over the blocks (MoE layers and dense ones); dense_s: a
    dense layer's, gemm_s: the time model's GEMM; tp splits each expert's width (the router is whole)."""
    sh = ctx.shape
    e, fe, h = sh.num_experts, sh.expert_ffn_hidden_size / tp, sh.hidden_size
    rows = T * sh.experts_per_token / e
    experts = gemm_s(ctx, T, h, e) + e * (gemm_s(ctx, rows, h, 2 * fe) + gemm_s(ctx, rows, fe, h))
    share = len(sh.moe_layers) / sh.num_layers
    return share * experts + (1 - share) * dense_s


def swiglu_width(sh) -> float:
    """The SwiGLU width per token, averaged over the blocks: top-k experts' (and the rows gathered to them and back,
    0.4 h each in the element-wise count's units), or the dense MLP's."""
    share = len(sh.moe_layers) / sh.num_layers
    return share * sh.experts_per_token * (sh.expert_ffn_hidden_size + 0.4 * sh.hidden_size) + (1 - share) * \
        sh.ffn_hidden_size


def ep_degrees(sh, dp: int, fixed: dict) -> list[int]:
    """The ep degrees a search tries at this dp: the job's, else 1 for a dense model, else every divisor of dp that
    splits the experts evenly."""
    if "ep" in fixed:
        return [int(fixed["ep"])]
    if not sh.num_experts:
        return [1]
    return [e for e in range(1, dp + 1) if dp % e == 0 and sh.num_experts % e == 0]


def ep_problem(sh, dp: int, ep: int) -> str | None:
    if ep == 1:
        return None
    if not sh.num_experts:
        return f"parallel.ep ({ep}) needs a mixture of experts (model.num_experts is 0); set parallel.ep: 1"
    if dp % ep:
        return f"parallel.ep ({ep}) must divide dp ({dp}): experts are split over data-parallel ranks"
    if sh.num_experts % ep:
        return f"parallel.ep ({ep}) must divide model.num_experts ({sh.num_experts})"
    return None


def _link(ctx, lay) -> tuple[float, float]:
    hw = ctx.hw
    across = lay.ep * lay.tp * lay.cp > ctx.node_size
    lat = (hw.inter_latency_us if across else hw.intra_latency_us) * 1e-6
    return lat, hw.inter_node_gbps if across else hw.intra_node_gbps


def dispatch_s(ctx, lay) -> float:
    """Seconds per optimizer step of the token all-to-alls on one rank."""
    sh, ep = ctx.shape, lay.ep
    rows = local_tokens(sh, lay) * sh.experts_per_token
    nbytes = rows * sh.hidden_size * ctx.w_bytes * (ep - 1) / ep
    lat, gbps = _link(ctx, lay)
    passes = 2 + (1 if lay.activation_checkpointing != "none" else 0)
    per_layer = 2 * ((ep - 1) * lat + nbytes / (gbps * 1e9))
    return lay.grad_accum * len(sh.moe_layers) * passes * per_layer * ctx.comm_factor


def dense_average_s(ctx, lay) -> float:
    """The shared weights' gradients averaged over ep every micro-batch (ring all-reduce)."""
    sh, ep = ctx.shape, lay.ep
    shared = (stage_params(sh, lay.tp, 1, 0, sh.num_layers)
              - len(sh.moe_layers) * sh.num_experts * sh.expert_params // lay.tp)
    lat, gbps = _link(ctx, lay)
    nbytes = max(0, shared) * ctx.comm_bytes
    return lay.grad_accum * (2 * (ep - 1) * lat + 2 * (ep - 1) / ep * nbytes / (gbps * 1e9)) * ctx.comm_factor


register(TimeTerm("ep_dispatch_s", applies=lambda ctx, lay: lay.ep > 1, seconds=dispatch_s, kind="communication",
                  source="docs/PLANNER.md, Expert parallelism: two all-to-alls per MoE layer and pass"))
register(TimeTerm("ep_dense_average_s", applies=lambda ctx, lay: lay.ep > 1, seconds=dense_average_s,
                  kind="communication",
                  source="docs/PLANNER.md, Expert parallelism: the shared weights' gradients averaged over ep"))
