"""Step time of one layout, from first principles: GEMMs at the shapes each rank runs (gemm.py), fused attention
at its own efficiency, element-wise work at memory bandwidth, host launch overhead (a floor on GPUs, where the
host runs ahead; added on CPUs, where one core does both), collectives by NCCL's own algorithm/protocol cost
model per bucket and group (comm_model.py), overlap only where the engine overlaps, the 1F1B pipeline with
unequal stages, ZeRO-3's per-module gathers in every micro-batch, the optimizer step, and the wait for the
slowest of n GPUs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rayspeed.config.layout import Layout
from rayspeed.planner import adapter_terms, cp_terms, ep_terms  # noqa: F401  (cp_ and ep_terms register terms)
from rayspeed.planner import gemm as gemm_model
from rayspeed.planner.adapter_terms import trained_and_frozen
from rayspeed.planner.comm_model import Group, Link, bucketed, collective_s, nccl_s
from rayspeed.planner.grad_pass import grad_pass_bytes_per_param
from rayspeed.planner.inputs import Ctx
from rayspeed.planner.memory import LOSS_CHUNK_ELEMENTS, ZERO3_TENSORS_PER_LAYER, buckets, cp_scheme, tiled_fraction
from rayspeed.planner.model_math import local_tokens, max_stage_params, split_of
from rayspeed.planner.pipeline_schedule import critical_sends, one_f_one_b
from rayspeed.planner.terms import time_terms

__all__ = ["StepTime", "step_time", "gemm_s", "Link", "collective_s", "block_cost", "head_cost", "embed_cost",
           "block_work", "engine_overheads"]

ZERO3_PER_TENSOR_S = 0.0006  # ZeRO-3 fetch/release bookkeeping per gathered tensor per pass (H200 anchor:
#                              774M on 1 GPU, 380.6 ms vs 207.5 ms at ZeRO-1 = 173 ms over 146 tensors x 2 passes)
OVERLAP_TAX = 0.19  # overlapped communication slows the compute it hides behind (shared SMs, HBM): docs/PLANNER.md
KERNELS_FWD_PER_LAYER = 30  # eager ops in one block's forward (norms, projections, RoPE, attention, SwiGLU)
KERNELS_BWD_PER_LAYER = 50
OPTIMIZER_BYTES_PER_PARAM = 36  # fused Adam: read w,g,m,v + write w,m,v (fp32), grad norm, bf16 copy-out


@dataclass
class StepTime:
    compute_s: float  # forward + backward + recomputation of all micro-batches on the slowest stage
    recompute_s: float  # part of compute_s spent recomputing activations
    tp_comm_s: float  # tensor-parallel collectives (critical path)
    pp_bubble_s: float  # pipeline fill and drain
    pp_p2p_s: float  # pipeline sends on the critical path
    dp_comm_s: float  # exposed data-parallel / ZeRO communication
    dp_comm_total_s: float  # all data-parallel communication, hidden or not
    zero3_overhead_s: float  # ZeRO-3 gather bookkeeping
    optimizer_s: float  # optimizer step + engine overhead
    straggler_s: float = 0.0  # waiting for the slowest GPU of the job at every synchronisation
    terms: dict[str, tuple[float, str]] = field(default_factory=dict)  # features' (seconds, kind): planner/terms.py

    def _terms(self, kind: str) -> float:
        return sum(s for s, k in self.terms.values() if k == kind)

    @property
    def step_s(self) -> float:
        return (self.compute_s + self.tp_comm_s + self.pp_bubble_s + self.pp_p2p_s + self.dp_comm_s
                + self.zero3_overhead_s + self.optimizer_s + self.straggler_s + sum(s for s, _ in self.terms.values()))

    def as_dict(self) -> dict:
        d = {k: round(v, 6) for k, v in self.__dict__.items() if k != "terms"}
        d.update({k: round(s, 6) for k, (s, _) in self.terms.items()})
        d["step_s"] = round(self.step_s, 6)
        return d

    def groups(self) -> tuple[float, float, float]:
        """(compute, communication, overhead) seconds: what the fitted efficiency factors scale."""
        return (self.compute_s + self.pp_bubble_s + self.straggler_s + self._terms("compute"),
                self.tp_comm_s + self.pp_p2p_s + self.dp_comm_s + self._terms("communication"),
                self.optimizer_s + self.zero3_overhead_s + self._terms("overhead"))


# ---------------------------------------------------------------- compute


def gemm_s(ctx: Ctx, M: float, K: float, N: float) -> float:
    """One GEMM (M x K) @ (K x N) on one rank: measured throughput at this shape when the profile has it,
    else the quantized soft roofline."""
    hw = ctx.hw
    t = gemm_model.measured_s(ctx.gemm_table, M, K, N)
    if t is None:
        t = gemm_model.roofline_s(M, K, N, hw.peak(ctx.precision), hw.gemm_efficiency, hw.hbm_gbps * 1e9,
                                  ctx.w_bytes, hw.sm_count)
    return t * ctx.compute_factor


def _mem_s(ctx: Ctx, nbytes: float) -> float:
    return nbytes / (ctx.hw.hbm_gbps * 1e9 * ctx.hw.mem_efficiency) * ctx.compute_factor


def attention_efficiency(ctx: Ctx) -> float:
    """Fused attention reaches less of peak with small heads (FlashAttention-2 on H100: ~35% of peak at head
    dim 128, ~28% at 64, forward and backward together), relative to the head dim it was measured at."""
    return ctx.hw.attention_efficiency * min(1.0, (ctx.shape.head_dim / ctx.hw.attention_head_dim) ** 0.3)


def attention_keys(ctx: Ctx) -> float:
    """Keys per query the attention kernel computes, averaged over the layers: s / 2 for plain causal attention
    (the fused kernels skip the tiles above the diagonal); s for a layer that attends through a mask (a sliding
    window shorter than s, or document masks): SDPA's masked kernels compute every tile and mask afterwards, so a
    window saves memory traffic nowhere and time only under a block-sparse kernel, which rayspeed does not run
    yet. The model FLOPs of MFU count the window instead (ModelShape.flops_per_token)."""
    sh = ctx.shape
    if ctx.document_masking or sh.math_attention:  # soft-caps and sinks run the math path: every score
        return float(sh.seq_len)
    masked = sh.windowed_layers
    return (masked * sh.seq_len + (sh.num_layers - masked) * sh.seq_len / 2) / sh.num_layers


def _combine(ctx: Ctx, work: float, host: float) -> float:
    # A GPU runs kernels while the host queues the next ones: the slower of the two. A CPU worker does both
    # on the same core, one after the other.
    return max(work, host) if ctx.hw.is_gpu else work + host


def engine_overheads(ctx: Ctx, lay: Layout) -> tuple[float, float, float, float]:
    """Seconds of host time per block forward and backward, fixed host time per micro-batch, and the engine's
    time per optimizer step: measured for this ZeRO stage when the profile has it, else the table's."""
    f = ctx.overhead_factor
    for z, fwd_us, bwd_us, fixed_us, step_s in ctx.engine_by_zero:
        if z == lay.zero_stage:
            return fwd_us * 1e-6 * f, bwd_us * 1e-6 * f, fixed_us * 1e-6 * f, step_s * f
    hw = ctx.hw
    fwd = hw.host_fwd_layer_us or KERNELS_FWD_PER_LAYER * hw.kernel_overhead_us
    bwd = hw.host_bwd_layer_us or KERNELS_BWD_PER_LAYER * hw.kernel_overhead_us
    return fwd * 1e-6 * f, bwd * 1e-6 * f, hw.host_fixed_mb_us * 1e-6 * f, hw.engine_step_s * f


def block_work(ctx: Ctx, lay: Layout) -> tuple[float, float]:
    """(forward, backward) work of one block for one micro-batch before any measured scale and without host
    time: what a calibration compares its measurement of the real block against."""
    T = local_tokens(ctx.shape, lay)
    g, ew, _ = layer_fwd(ctx, lay)
    return g + ew, 2 * g + attention_bwd_extra(ctx, lay, T) + 2 * ew


def attention_bwd_extra(ctx: Ctx, lay: Layout, T: float) -> float:
    """Attention's backward beyond twice its forward (6 passes of s x keys per head dim), plus the forward again in
    the layers whose masks are built a tile at a time (memory.tiled_fraction: each tile is recomputed)."""
    sh, hw = ctx.shape, ctx.hw
    frac = tiled_fraction(sh, lay.micro_batch_size, ctx.document_masking, lay.cp > 1 and cp_scheme(ctx, lay) == "ring")
    return ((6.0 + 4.0 * frac) * T * attention_keys(ctx) * sh.q_dim / lay.tp
            / (hw.peak(ctx.precision) * attention_efficiency(ctx)) * ctx.compute_factor)


def dense_gemm_s(ctx: Ctx, lay: Layout) -> float:
    """One block's projections (q, k, v, o, gate, up, down) forward for one micro-batch (a mixture of experts' MLP:
    planner/ep_terms.py mlp_gemm_s)."""
    sh = ctx.shape
    h, q, f, kv, t, T = sh.hidden_size, sh.q_dim, sh.ffn_hidden_size, sh.kv_dim, lay.tp, local_tokens(sh, lay)
    attention = gemm_s(ctx, T, h, (q + 2 * kv) / t) + gemm_s(ctx, T, q / t, h)
    dense = gemm_s(ctx, T, h, 2 * f / t) + gemm_s(ctx, T, f / t, h)
    return attention + (ep_terms.mlp_gemm_s(ctx, T, dense, gemm_s, t) if sh.num_experts else dense)


def layer_fwd(ctx: Ctx, lay: Layout) -> tuple[float, float, float]:
    """One block's forward for one micro-batch: (gemm+attention s, element-wise s, host launch s)."""
    sh, hw, t = ctx.shape, ctx.hw, lay.tp
    # q/o widths are heads * head_dim (q), k/v kv_heads * head_dim: hidden only where the family's rule says so.
    h, q, f, kv = sh.hidden_size, sh.q_dim, sh.ffn_hidden_size, sh.kv_dim
    T = local_tokens(sh, lay)
    g = dense_gemm_s(ctx, lay)
    attn_flops = 4.0 * T * attention_keys(ctx) * q / t  # QK^T and AV over the keys the kernel computes
    g += attn_flops / (hw.peak(ctx.precision) * attention_efficiency(ctx)) * ctx.compute_factor
    out_div = t if lay.sequence_parallel else 1
    # Element-wise traffic in working-dtype elements per token, forward. Outside the tp region: two RMSNorms
    # computed in fp32 (~6h each: read, fp32 statistics, scaled write) and two residual adds (3h each).
    # Inside: RoPE on q and k in fp32 (~3 passes), the attention-output reshape (2 q), SwiGLU silu and
    # product (5f). Backward moves about twice as much.
    width = ep_terms.swiglu_width(sh) if sh.num_experts else float(f)
    elems = T * (18 * h / out_div + (3 * (q + kv) + 2 * q + 5 * width) / t)
    return g, _mem_s(ctx, elems * ctx.w_bytes), engine_overheads(ctx, lay)[0]


@dataclass(frozen=True)
class BlockCost:
    """One block, one micro-batch, one rank."""
    fwd: float
    bwd: float
    rec: float  # recomputation in backward
    tp: float  # tensor-parallel collectives (fwd + bwd + recompute)

    @property
    def total(self) -> float:
        return self.fwd + self.bwd + self.rec + self.tp


def block_cost(ctx: Ctx, lay: Layout) -> BlockCost:
    key = ("block", lay.tp, lay.cp, lay.micro_batch_size, lay.sequence_parallel, lay.activation_checkpointing,
           lay.zero_stage)
    got = ctx.memo.get(key)
    if got is None:
        got = ctx.memo[key] = _block_cost(ctx, lay)
    return got


def _block_cost(ctx: Ctx, lay: Layout) -> BlockCost:
    sh, hw, t = ctx.shape, ctx.hw, lay.tp
    T = local_tokens(sh, lay)
    g, ew, host = layer_fwd(ctx, lay)
    g_fwd, g_bwd = g, 2 * g
    if ctx.adapter is not None:  # frozen projections: no weight gradient; the adapters' thin GEMMs (adapter_terms)
        dense = dense_gemm_s(ctx, lay)
        a_fwd, a_bwd = adapter_terms.gemm_seconds(ctx, lay, gemm_s, dense)
        g_fwd, g_bwd = g - dense + a_fwd, 2 * (g - dense) + a_bwd
        deq = _mem_s(ctx, adapter_terms.dequant_bytes(ctx, lay))  # QLoRA: W unpacked forward and backward
        g_fwd, g_bwd = g_fwd + deq, g_bwd + deq
    attn_bwd_extra = attention_bwd_extra(ctx, lay, T)
    # A calibrated profile anchors the block at the real block it measured (work_scale_*: measured / modelled
    # at its reference layout); elsewhere the model's ratio to that reference carries it.
    fwd = _combine(ctx, g_fwd + ew, host) * hw.work_scale_fwd
    bwd = _combine(ctx, g_bwd + attn_bwd_extra + 2 * ew, engine_overheads(ctx, lay)[1]) * hw.work_scale_bwd
    rec = 0.0
    if lay.activation_checkpointing == "full":
        rec = fwd
    elif lay.activation_checkpointing == "selective":
        rec = _combine(ctx, g_fwd + 0.8 * ew, host)  # residual adds are not rebuilt
    tp = 0.0
    if t > 1:
        act = T * sh.hidden_size * ctx.w_bytes
        per_layer = 4 + (2 if lay.activation_checkpointing != "none" else 0)  # 2 fwd + 2 bwd (+2 recompute)
        grp = tp_group(ctx, lay)
        if lay.sequence_parallel:  # each all-reduce becomes all-gather + reduce-scatter: same bytes, two calls
            one = coll_s(ctx, "all_gather", act, grp) + coll_s(ctx, "reduce_scatter", act, grp)
        else:
            one = coll_s(ctx, "allreduce", act, grp)
        tp = per_layer * one
    return BlockCost(fwd, bwd, rec, tp)


def head_cost(ctx: Ctx, lay: Layout) -> tuple[float, float]:
    """(fwd+bwd, bwd) of the final norm, output head and cross-entropy for one micro-batch on the last stage."""
    key = ("head", lay.tp, lay.cp, lay.micro_batch_size)
    got = ctx.memo.get(key)
    if got is None:
        got = ctx.memo[key] = _head_cost(ctx, lay)
    return got


def _head_cost(ctx: Ctx, lay: Layout) -> tuple[float, float]:
    sh = ctx.shape
    T = local_tokens(sh, lay)
    head = gemm_s(ctx, T, sh.hidden_size, sh.vocab_size / lay.tp)
    ce = _mem_s(ctx, T * sh.vocab_size / lay.tp * (ctx.w_bytes + 16))
    # The chunked loss (every tp) recomputes each chunk's logits in backward: forward, that, and two for the grads.
    comp, back = 4 * head + ce, 3 * head + ce / 2
    if lay.tp > 1:  # per chunk of this rank's slice: the max, then the target logit with the sum of exponentials
        grp = tp_group(ctx, lay)
        chunks = max(1, math.ceil(T * sh.vocab_size / lay.tp / LOSS_CHUNK_ELEMENTS))
        comp += chunks * (coll_s(ctx, "allreduce", T / chunks * 4, grp) + coll_s(ctx, "allreduce", T / chunks * 8, grp))
    return comp, back


def embed_cost(ctx: Ctx, lay: Layout) -> float:
    """The embedding lookup and its gradient scatter (their traffic), plus the vocab-parallel all-reduce."""
    key = ("embed", lay.tp, lay.cp, lay.micro_batch_size)
    got = ctx.memo.get(key)
    if got is None:
        got = ctx.memo[key] = _embed_cost(ctx, lay)
    return got


def _embed_cost(ctx: Ctx, lay: Layout) -> float:
    sh = ctx.shape
    T = local_tokens(sh, lay)
    c = _mem_s(ctx, 2 * T * sh.hidden_size * ctx.w_bytes)
    if lay.tp > 1:
        c += coll_s(ctx, "allreduce", T * sh.hidden_size * ctx.w_bytes, tp_group(ctx, lay))
    return c


# ---------------------------------------------------------------- communication groups


def coll_s(ctx: Ctx, kind: str, nbytes: float, grp: Group) -> float:
    """One collective call on this cluster: NCCL's model on GPUs, latency + bandwidth with ring hops on CPUs."""
    if grp.ranks <= 1 or nbytes <= 0:
        return 0.0
    hw = ctx.hw
    if hw.is_gpu:
        return nccl_s(kind, float(int(nbytes)), grp) * ctx.comm_factor
    spans = grp.nodes > 1
    link = Link(grp.busbw_gbps, hw.inter_latency_us if spans else hw.intra_latency_us,
                hw.inter_hop_us if spans else hw.intra_hop_us)
    for k, lat_us, gbps in ctx.gloo_fit:  # gloo's collectives differ by kind: each measured on its own
        if k == kind and not spans:
            link = Link(gbps, lat_us, 0.0)
    return collective_s(nbytes, grp.ranks, link, kind) * ctx.comm_factor


def _group(ctx: Ctx, ranks: int, per_node: int) -> Group:
    hw = ctx.hw
    per_node = max(1, min(ranks, per_node))
    nodes = -(-ranks // per_node)
    busbw = hw.intra_node_gbps if nodes == 1 else min(hw.intra_node_gbps, per_node * hw.inter_node_gbps)
    return Group(ranks, nodes, busbw, hw.intra_link, ll128=nodes == 1 and hw.intra_link == "nvlink",
                 latency_scale=hw.nccl_latency_scale, algo=ctx.nccl_algo)


def tp_group(ctx: Ctx, lay: Layout) -> Group:
    """Consecutive ranks: one node while tp fits in it (the topology rule); beyond, node-size pieces."""
    return _group(ctx, lay.tp, ctx.node_size)


def dp_group(ctx: Ctx, lay: Layout) -> Group:
    """Ranks are placed tp-fastest, then dp, then pp: a node holds node_size / tp ranks of a dp group, and a
    group spanning nodes gets the NICs its ranks own on each node (NCCL runs one ring per NIC)."""
    return _group(ctx, lay.zero_ranks, max(1, ctx.node_size // lay.tp))


def hpz_group(ctx: Ctx, lay: Layout) -> Group:
    return _group(ctx, lay.hpz, lay.hpz)


def p2p_s(ctx: Ctx, lay: Layout, nbytes: float) -> float:
    """One pipeline send between neighbouring stages: over the network when a stage fills whole nodes (ranks
    are tp, then dp, then pp), else over NVLink."""
    hw = ctx.hw
    across = ctx.world > ctx.node_size and lay.tp * lay.zero_ranks >= ctx.node_size
    lat = hw.inter_latency_us if across else hw.intra_latency_us
    gbps = hw.inter_node_gbps if across else hw.intra_node_gbps
    scale = hw.nccl_latency_scale if hw.is_gpu else 1.0
    return (lat * scale * 1e-6 + nbytes / (gbps * 1e9)) * ctx.comm_factor


# ---------------------------------------------------------------- the step


def stage_parts(ctx: Ctx, lay: Layout) -> list[tuple[float, float, float, float]]:
    """Per stage, one micro-batch: (compute, recompute, tp comm, backward compute)."""
    split = split_of(ctx.shape, lay)
    bc = block_cost(ctx, lay)
    head_c, head_b = head_cost(ctx, lay)
    emb = embed_cost(ctx, lay)
    host_f, host_b, fixed, _ = engine_overheads(ctx, lay)
    hs = ctx.hw.head_work_scale  # embedding + head + loss (+ the engine's fixed host time), anchored like the block
    # DeepSpeed's pipeline engine's own host work per micro-batch on every stage (its instructions, input clones,
    # p2p calls): hardware.pipe_host_mb_us, measured by scripts/bench_pipeline_overhead.py.
    pipe = ctx.hw.pipe_host_mb_us * 1e-6 * ctx.overhead_factor if lay.pp > 1 else 0.0
    hp = grad_pass_bytes_per_param(ctx, lay)
    out = []
    for i, n in enumerate(split):
        comp = n * (bc.fwd + bc.bwd + bc.rec)
        if hp:  # every micro-batch's gradients pass through memory once more (grad_pass_bytes_per_param)
            comp += _mem_s(ctx, hp * trained_and_frozen(ctx, lay, i, n)[0])
        back = n * (bc.bwd + bc.rec)
        tp = n * bc.tp
        last = i == lay.pp - 1
        if last:
            comp += head_c * hs
            back += head_b * hs
        host = pipe + (fixed if last else 0.0)
        if host:  # the engine's per-micro-batch host work: after the kernels on a CPU, beside them on a GPU
            comp = (max(comp, host + n * (host_f + host_b)) if ctx.hw.is_gpu
                    else comp + pipe + (fixed * hs if last else 0.0))
        if i == 0:
            comp += emb * hs
        out.append((comp, n * bc.rec, tp, back))
    return out


def step_time(ctx: Ctx, lay: Layout) -> StepTime:
    ctx, lay = ctx.in_rows(lay)
    sh, hw = ctx.shape, ctx.hw
    m, p, d = lay.grad_accum, lay.pp, lay.zero_ranks
    split = split_of(sh, lay)
    parts = stage_parts(ctx, lay)
    slot = [c + tp for c, _, tp, _ in parts]
    worst = max(range(p), key=lambda i: slot[i])
    comp, rec, tpc, back = parts[worst]

    # 1F1B (pipeline_schedule): the first micro-batch crosses every stage, the other m - 1 follow at the pace of
    # the slowest one; every send waits for its receive.
    p2p = 0.0
    if p > 1:
        T = local_tokens(sh, lay)
        nbytes = T * sh.hidden_size * ctx.w_bytes / (lay.tp if lay.sequence_parallel else 1)
        p2p = critical_sends(p, m) * p2p_s(ctx, lay, nbytes)
    compute = m * comp
    bubble = one_f_one_b(slot, m)[1]
    tp_total = m * tpc

    # Data parallel / ZeRO, for the stage whose parameters are largest (the one the others wait for).
    n_stage = max_stage_params(sh, lay.tp, p, split, lay.ep)
    n_train = trained_and_frozen(ctx, lay, 0, max(split), n_stage)[0]  # an adapter job reduces what trains only
    grads, weights, updated = n_train * ctx.comm_bytes, n_stage * ctx.w_bytes, n_train * ctx.w_bytes
    b = buckets(ctx, lay)
    grp = dp_group(ctx, lay)

    def reduce_(nbytes: float) -> float:  # DeepSpeed ZeRO-0..2 all-reduce bucket by bucket (see below)
        return bucketed(lambda x: coll_s(ctx, "allreduce", x, grp), nbytes, b["reduce_bucket_size"] * ctx.comm_bytes)

    def gather_(nbytes: float) -> float:
        return bucketed(lambda x: coll_s(ctx, "all_gather", x, grp), nbytes, b["allgather_bucket_size"] * ctx.w_bytes)

    if not hw.is_gpu:
        back = 0.0  # no side stream: the collective runs after the backward
    dp_total = dp_exposed = z3 = 0.0
    if d > 1 or lay.zero_stage == 3:
        if lay.zero_stage in (0, 1):  # once per step, in the last micro-batch's backward
            # DeepSpeed 0.19.8 ZeRO-1/2 reduce every bucket with an all-reduce (use_multi_rank_bucket_allreduce,
            # stage_1_and_2.average_tensor), then keep their partition: all-reduce volume, not reduce-scatter.
            red = reduce_(grads)
            gather = gather_(updated) if lay.zero_stage == 1 else 0.0
            # ZeRO-1's backward hooks reduce buckets during the last micro-batch's backward (overlap_comm).
            # Not hidden: ZeRO-0 (the flat gradients are all-reduced after backward), the pipeline engine
            # (reduces after the flush), CPU workers (no side stream).
            hidden = back if (lay.zero_stage == 1 and p == 1 and hw.is_gpu) else 0.0
            dp_total = red + gather
            dp_exposed = _exposed(red, hidden) + gather
        elif lay.zero_stage == 2:  # reduced in every micro-batch's backward (gradients are partitioned)
            red = reduce_(grads)
            gather = gather_(updated)
            dp_total = m * red + gather
            dp_exposed = m * _exposed(red, back) + gather
        else:  # ZeRO-3: per micro-batch, gather weights module by module in forward and backward, reduce grads
            modules = ZERO3_TENSORS_PER_LAYER * max(split) + 1
            fwd_time = comp - back if hw.is_gpu else 0.0  # CPU workers: no side stream in forward either
            per_module = weights / modules
            ag_f = modules * coll_s(ctx, "all_gather", per_module, grp)
            if lay.hpz > 1:  # backward gathers from the node-local secondary partition over NVLink
                ag_b = modules * coll_s(ctx, "all_gather", per_module, hpz_group(ctx, lay))
            else:
                ag_b = ag_f
            red = bucketed(lambda x: coll_s(ctx, "reduce_scatter", x, grp), grads,
                           b["reduce_bucket_size"] * ctx.comm_bytes)
            dp_total = m * (ag_f + ag_b + red)
            dp_exposed = m * (_exposed(ag_f, fwd_time) + _exposed(ag_b + red, back))
            z3 = m * 2 * modules * ZERO3_PER_TENSOR_S * ctx.overhead_factor
    if sh.tie_embeddings and p > 1:  # tied embedding: first and last stage all-reduce its gradient
        tie = _group(ctx, 2, 1 if ctx.world > ctx.node_size else 2)
        dp_exposed += coll_s(ctx, "allreduce", sh.vocab_size * sh.hidden_size / lay.tp * ctx.comm_bytes, tie)

    owned = n_train / (d if lay.zero_stage >= 1 else 1)
    opt = _mem_s(ctx, owned * OPTIMIZER_BYTES_PER_PARAM) + engine_overheads(ctx, lay)[3]
    # Synchronous steps wait for the slowest GPU: the expected maximum of n draws is sigma * sqrt(2 ln n)
    # above the mean (a normal spread; Sinha et al. SC22 for the spread itself).
    world = ctx.world
    strag = 0.0
    if world > 1 and hw.straggler_sigma > 0:
        strag = (compute + bubble) * hw.straggler_sigma * math.sqrt(2 * math.log(world))
    st = StepTime(compute_s=compute, recompute_s=m * rec, tp_comm_s=tp_total, pp_bubble_s=bubble,
                  pp_p2p_s=p2p, dp_comm_s=dp_exposed, dp_comm_total_s=dp_total, zero3_overhead_s=z3,
                  optimizer_s=opt, straggler_s=strag, terms=time_terms(ctx, lay))
    return st


def _exposed(comm: float, window: float) -> float:
    """Communication overlapped with `window` seconds of compute: what sticks out, plus a tax on what hid."""
    return max(0.0, comm - window) + OVERLAP_TAX * min(comm, window)
