"""Step time of one layout, from first principles: GEMMs on a soft roofline (FLOPs at the measured best GEMM
efficiency plus the bytes they move at HBM bandwidth, so small per-GPU work runs at lower efficiency),
fused attention at its own efficiency, element-wise work at memory bandwidth, host launch overhead as a
floor, collectives as latency + bytes / bus bandwidth with their overlap, the 1F1B pipeline bubble,
ZeRO-3's per-tensor gather cost, and the optimizer step."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rayspeed.config.layout import Layout
from rayspeed.planner.inputs import Ctx
from rayspeed.planner.memory import ZERO3_TENSORS_PER_LAYER, buckets
from rayspeed.planner.model_math import stage_params

MEM_EFFICIENCY = 0.8  # element-wise kernels reach ~80% of HBM bandwidth
DEEPSPEED_STEP_S = 0.005  # engine cost per optimizer step beyond the math (H200 anchor: ZeRO-1 vs eager)
ZERO3_PER_TENSOR_S = 0.0006  # ZeRO-3 fetch/release bookkeeping per gathered tensor per pass (H200 anchor:
#                              774M on 1 GPU, 380.6 ms vs 207.5 ms at ZeRO-1 = 173 ms over 146 tensors x 2 passes)
OVERLAP_TAX = 0.1  # overlapped communication still slows the compute it hides behind (shared SMs, HBM)
KERNELS_FWD_PER_LAYER = 30  # eager ops in one block's forward (norms, projections, RoPE, attention, SwiGLU)
KERNELS_BWD_PER_LAYER = 50
OPTIMIZER_BYTES_PER_PARAM = 36  # fused Adam: read w,g,m,v + write w,m,v (fp32), grad norm, bf16 copy-out


@dataclass
class StepTime:
    compute_s: float  # forward + backward + recomputation of all micro-batches (critical path, no bubble)
    recompute_s: float  # part of compute_s spent recomputing activations
    tp_comm_s: float  # tensor-parallel collectives (critical path)
    pp_bubble_s: float  # pipeline fill and drain
    pp_p2p_s: float  # pipeline sends on the critical path
    dp_comm_s: float  # exposed data-parallel / ZeRO communication
    dp_comm_total_s: float  # all data-parallel communication, hidden or not
    zero3_overhead_s: float  # ZeRO-3 gather bookkeeping
    optimizer_s: float  # optimizer step + engine overhead

    @property
    def step_s(self) -> float:
        return (self.compute_s + self.tp_comm_s + self.pp_bubble_s + self.pp_p2p_s + self.dp_comm_s
                + self.zero3_overhead_s + self.optimizer_s)

    def as_dict(self) -> dict:
        d = {k: round(v, 6) for k, v in self.__dict__.items()}
        d["step_s"] = round(self.step_s, 6)
        return d


def gemm_s(ctx: Ctx, M: float, K: float, N: float) -> float:
    """One GEMM (M x K) @ (K x N): FLOPs at the best efficiency plus its operand traffic at HBM speed
    (a soft roofline: thin GEMMs from small micro-batches or large tp fall well below peak)."""
    hw = ctx.hw
    flops = 2.0 * M * K * N
    traffic = ctx.w_bytes * (M * K + K * N + M * N)
    return flops / (hw.peak(ctx.precision) * hw.gemm_efficiency) + traffic / (hw.hbm_gbps * 1e9)


@dataclass(frozen=True)
class Link:
    gbps: float  # bus bandwidth
    base_us: float  # fixed cost per call
    hop_us: float  # cost per algorithm step


def collective_s(nbytes: float, ranks: int, link: Link, kind: str, calls: int = 1) -> float:
    """NCCL-style cost: (n-1)/n * bytes / bus bandwidth (twice for all-reduce) plus, per call, a fixed cost and
    one hop per algorithm step: a ring all-gather or reduce-scatter takes n - 1 steps, an all-reduce runs as a
    tree (2 log2 n steps) or a ring, whichever is shorter."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    factor = 2.0 if kind == "allreduce" else 1.0
    steps = min(2 * (ranks - 1), 2 * math.ceil(math.log2(ranks))) if kind == "allreduce" else ranks - 1
    calls = max(1, calls)
    return (factor * (ranks - 1) / ranks * nbytes / (link.gbps * 1e9)
            + calls * (link.base_us + steps * link.hop_us) * 1e-6)


def intra_link(ctx: Ctx) -> Link:
    hw = ctx.hw
    return Link(hw.intra_node_gbps, hw.intra_latency_us, hw.intra_hop_us)


def inter_link(ctx: Ctx, gbps: float | None = None) -> Link:
    hw = ctx.hw
    return Link(gbps or hw.inter_node_gbps, hw.inter_latency_us, hw.inter_hop_us)


def tp_link(ctx: Ctx, lay: Layout) -> Link:
    """NVLink while the tp group fits in a node; beyond, each rank's own NIC (TP's mid-size messages do not
    reach the aggregate bandwidth of big DP transfers: the measured ~40% loss per doubling past a node)."""
    return intra_link(ctx) if lay.tp <= ctx.node_size else inter_link(ctx)


def dp_link(ctx: Ctx, lay: Layout) -> Link:
    """Ranks are placed tp-fastest, then dp, then pp. A dp group inside one node uses NVLink; one that
    spans nodes is bounded by the NICs its ranks own on each node (NCCL runs one ring per NIC)."""
    if lay.tp * lay.dp <= ctx.node_size:
        return intra_link(ctx)
    per_node = dp_ranks_per_node(ctx, lay)
    return inter_link(ctx, min(ctx.hw.intra_node_gbps, per_node * ctx.hw.inter_node_gbps))


def dp_ranks_per_node(ctx: Ctx, lay: Layout) -> int:
    return max(1, min(lay.dp, ctx.node_size // lay.tp))


def attention_efficiency(ctx: Ctx) -> float:
    """Fused attention reaches less of peak with small heads (FlashAttention-2 on H100: ~35% of peak at head
    dim 128, ~28% at 64, forward and backward together)."""
    return ctx.hw.attention_efficiency * min(1.0, (ctx.shape.head_dim / 128) ** 0.3)


def layer_fwd(ctx: Ctx, lay: Layout) -> tuple[float, float, float]:
    """One block's forward for one micro-batch: (gemm+attention s, element-wise s, host launch s)."""
    sh, hw, t = ctx.shape, ctx.hw, lay.tp
    T = lay.micro_batch_size * sh.seq_len
    g = (gemm_s(ctx, T, sh.hidden_size, (sh.hidden_size + 2 * sh.kv_dim) / t) + gemm_s(ctx, T, sh.hidden_size / t, sh.hidden_size)
         + gemm_s(ctx, T, sh.hidden_size, 2 * sh.ffn_hidden_size / t) + gemm_s(ctx, T, sh.ffn_hidden_size / t, sh.hidden_size))
    attn_flops = 2.0 * T * sh.seq_len * sh.hidden_size / t  # causal: half of QK^T and AV
    g += attn_flops / (hw.peak(ctx.precision) * attention_efficiency(ctx))
    out_div = t if lay.sequence_parallel else 1
    # Element-wise traffic in working-dtype elements per token, forward. Outside the tp region: two RMSNorms
    # computed in fp32 (~6h each: read, fp32 statistics, scaled write) and two residual adds (3h each).
    # Inside: RoPE on q and k in fp32 (~3 passes), the attention-output reshape (2h), SwiGLU silu and
    # product (5f). Backward moves about twice as much.
    elems = T * (18 * sh.hidden_size / out_div + (3 * (sh.hidden_size + sh.kv_dim) + 2 * sh.hidden_size + 5 * sh.ffn_hidden_size) / t)
    ew = elems * ctx.w_bytes / (hw.hbm_gbps * 1e9 * MEM_EFFICIENCY)
    host = KERNELS_FWD_PER_LAYER * hw.kernel_overhead_us * 1e-6
    return g, ew, host


def microbatch_stage_s(ctx: Ctx, lay: Layout, stage: int) -> tuple[float, float, float, float]:
    """(compute, recompute, tp comm, backward compute) for one micro-batch on one stage."""
    sh, hw, t = ctx.shape, ctx.hw, lay.tp
    T = lay.micro_batch_size * sh.seq_len
    layers = sh.num_layers // lay.pp
    g, ew, host = layer_fwd(ctx, lay)
    attn_bwd_extra = 1.5 * 2.0 * T * sh.seq_len * sh.hidden_size / t / (hw.peak(ctx.precision) * attention_efficiency(ctx))
    fwd = max(g + ew, host)
    bwd = max(2 * g + attn_bwd_extra + 2 * ew, KERNELS_BWD_PER_LAYER * hw.kernel_overhead_us * 1e-6)
    rec = 0.0
    if lay.activation_checkpointing == "full":
        rec = fwd
    elif lay.activation_checkpointing == "selective":
        rec = max(g + 0.8 * ew, host)  # residual adds are not rebuilt
    comp = layers * (fwd + bwd + rec)
    back = layers * (bwd + rec)
    if stage == lay.pp - 1:  # output head + cross-entropy
        head = gemm_s(ctx, T, sh.hidden_size, sh.vocab_size / t)
        ce = T * sh.vocab_size / t * (ctx.w_bytes + 16) / (hw.hbm_gbps * 1e9 * MEM_EFFICIENCY)
        # tp = 1: the chunked loss recomputes the logits in backward (one more head GEMM).
        head_passes = 4 if t == 1 else 3
        comp += head_passes * head + ce
        back += (head_passes - 1) * head + ce / 2
    if stage == 0:  # embedding lookup (its traffic only)
        comp += 2 * T * sh.hidden_size * ctx.w_bytes / (hw.hbm_gbps * 1e9 * MEM_EFFICIENCY)
    tp = 0.0
    if t > 1:
        link = tp_link(ctx, lay)
        act = T * sh.hidden_size * ctx.w_bytes
        per_layer = 4 + (2 if lay.activation_checkpointing != "none" else 0)  # 2 fwd + 2 bwd (+2 recompute)
        if lay.sequence_parallel:  # each all-reduce becomes all-gather + reduce-scatter: same bytes, two calls
            one = collective_s(act, t, link, "all_gather") + collective_s(act, t, link, "reduce_scatter")
        else:
            one = collective_s(act, t, link, "allreduce")
        tp = layers * per_layer * one
        if stage == 0:
            tp += collective_s(act, t, link, "allreduce")  # vocab-parallel embedding
        if stage == lay.pp - 1:
            tp += collective_s(T * 12, t, link, "allreduce", 3)  # vocab-parallel loss: max, sum, target logit
    return comp, layers * rec, tp, back


def step_time(ctx: Ctx, lay: Layout) -> StepTime:
    sh, hw = ctx.shape, ctx.hw
    m, p, d = lay.grad_accum, lay.pp, lay.dp
    stages = sorted({0, p - 1})
    per = {st: microbatch_stage_s(ctx, lay, st) for st in stages}
    worst = max(stages, key=lambda st: per[st][0] + per[st][2])
    comp, rec, tpc, back = per[worst]

    # Pipeline: 1F1B runs m + p - 1 slots of the slowest stage; (p - 1) of them are the bubble. Each slot
    # receives an activation (forward) and a gradient (backward) over the stage boundary.
    p2p = 0.0
    if p > 1:
        T = lay.micro_batch_size * sh.seq_len
        nbytes = T * sh.hidden_size * ctx.w_bytes / (lay.tp if lay.sequence_parallel else 1)
        link = inter_link(ctx) if ctx.world > ctx.node_size else intra_link(ctx)
        p2p = (m + p - 1) * 2 * (link.base_us * 1e-6 + nbytes / (link.gbps * 1e9))
    compute = m * comp
    bubble = (p - 1) * (comp + tpc)
    tp_total = m * tpc

    # Data parallel / ZeRO.
    n_stage = stage_params(sh, lay.tp, p, worst)
    grads = n_stage * ctx.comm_bytes
    weights = n_stage * ctx.w_bytes
    link = dp_link(ctx, lay)
    calls = max(1, round(n_stage / buckets(ctx, lay)["reduce_bucket_size"]))
    if not hw.is_gpu:
        back = 0.0  # no overlap: the collective runs after the backward
    dp_total = dp_exposed = z3 = 0.0
    if d > 1 or lay.zero_stage == 3:
        if lay.zero_stage in (0, 1):  # once per step, in the last micro-batch's backward
            red = collective_s(grads, d, link, "allreduce" if lay.zero_stage == 0 else "reduce_scatter", calls)
            gather = collective_s(weights, d, link, "all_gather", calls) if lay.zero_stage == 1 else 0.0
            # ZeRO-1's backward hooks reduce buckets during the last micro-batch's backward (overlap_comm).
            # Not hidden: ZeRO-0 (DeepSpeed all-reduces the flat gradients after backward), the pipeline engine
            # (reduces after the flush), CPU workers (no side stream).
            hidden = back if (lay.zero_stage == 1 and p == 1 and hw.is_gpu) else 0.0
            dp_total = red + gather
            dp_exposed = _exposed(red, hidden) + gather
        elif lay.zero_stage == 2:  # reduce-scatter in every micro-batch's backward (gradients are partitioned)
            red = collective_s(grads, d, link, "reduce_scatter", calls)
            gather = collective_s(weights, d, link, "all_gather", calls)
            dp_total = m * red + gather
            dp_exposed = m * _exposed(red, back) + gather
        else:  # ZeRO-3: per micro-batch, gather weights module by module in forward and backward, reduce grads
            modules = ZERO3_TENSORS_PER_LAYER * (sh.num_layers // p) + 1
            fwd_time = comp - back
            ag_f = collective_s(weights, d, link, "all_gather", modules)
            if lay.hpz > 1:  # backward gathers from the node-local secondary partition over NVLink
                ag_b = collective_s(weights, lay.hpz, intra_link(ctx), "all_gather", modules)
            else:
                ag_b = ag_f
            red = collective_s(grads, d, link, "reduce_scatter", modules)
            dp_total = m * (ag_f + ag_b + red)
            dp_exposed = m * (_exposed(ag_f, fwd_time) + _exposed(ag_b + red, back))
            z3 = m * 2 * modules * ZERO3_PER_TENSOR_S
    if sh.tie_embeddings and p > 1:  # tied embedding: first and last stage all-reduce its gradient
        dp_exposed += collective_s(sh.vocab_size * sh.hidden_size / lay.tp * ctx.comm_bytes, 2, inter_link(ctx), "allreduce")

    owned = n_stage / (d if lay.zero_stage >= 1 else 1)
    opt = owned * OPTIMIZER_BYTES_PER_PARAM / (hw.hbm_gbps * 1e9 * MEM_EFFICIENCY) + DEEPSPEED_STEP_S
    return StepTime(compute_s=compute, recompute_s=m * rec, tp_comm_s=tp_total, pp_bubble_s=bubble,
                    pp_p2p_s=p2p, dp_comm_s=dp_exposed, dp_comm_total_s=dp_total, zero3_overhead_s=z3,
                    optimizer_s=opt)


def _exposed(comm: float, window: float) -> float:
    """Communication overlapped with `window` seconds of compute: what sticks out, plus a tax on what hid."""
    return max(0.0, comm - window) + OVERLAP_TAX * min(comm, window)
