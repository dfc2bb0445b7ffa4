"""Memory per rank, component by component, for the worst pipeline stage.

Playbook part A: bf16 weights 2N + bf16 grads 2N + fp32 master 4N + Adam 8N = 16 bytes/param, 20 with fp32
gradient accumulation; ZeRO-1 divides the 12N optimizer part by dp, ZeRO-2 also the gradients, ZeRO-3
everything. Activations are counted tensor by tensor for this platform's block (see `layer_saved`)."""

from __future__ import annotations

import functools

from rayspeed.config.context_split import scheme_for
from rayspeed.config.layout import Layout
from rayspeed.config.shape import ModelShape
from rayspeed.families.family import QK_NORM_PER_HEAD
from rayspeed.planner.adapter_terms import activation_elems_per_token, frozen_weight_bytes, trained_and_frozen
from rayspeed.planner.hardware import GIB
from rayspeed.planner.inputs import Ctx
from rayspeed.planner.model_math import local_tokens, split_of, stage_params
from rayspeed.planner.terms import memory_terms

COMPONENTS = ("weights", "gradients", "master_weights", "optimizer_states", "activations", "logits_loss",
              "zero3_gathered", "comm_buckets", "cuda_context", "allocator_slack")

# Gathered (non-persistent) tensors per layer under ZeRO-3: q, k, v, o, gate, up, down; the norms are
# below stage3_param_persistence_threshold and stay resident.
ZERO3_TENSORS_PER_LAYER = 7
# model/attention.py MASK_TILE_BYTES: a layer's mask above it is built a tile of query rows at a time.
MASK_TILE_BYTES = 1 << 26
# model/parts/mlp.py MLP_TILE_BYTES: under selective checkpointing a dense MLP is recomputed in tiles of rows whose
# intermediates stay under it.
MLP_TILE_BYTES = 1 << 28


def bytes_per_param(precision: str, grad_accum_dtype: str) -> dict:
    """Model-state bytes per parameter before any ZeRO division."""
    if precision == "fp32":
        return {"weights": 4, "gradients": 4, "master_weights": 0, "optimizer_states": 8}
    grads = 2 + (4 if grad_accum_dtype == "fp32" else 0)  # bf16/fp16 grads (+ fp32 accumulation buffer)
    return {"weights": 2, "gradients": grads, "master_weights": 4, "optimizer_states": 8}


def model_state_bytes(n_params: int, precision: str, grad_accum_dtype: str, zero_stage: int, dp: int) -> dict:
    return dict(_model_state_bytes(n_params, precision, grad_accum_dtype, zero_stage, dp))


@functools.lru_cache(maxsize=4096)  # a search asks for the same (stage size, ZeRO, dp) for many layouts
def _model_state_bytes(n_params: int, precision: str, grad_accum_dtype: str, zero_stage: int, dp: int) -> dict:
    b = dict(bytes_per_param(precision, grad_accum_dtype))
    if precision == "fp32" and zero_stage >= 1:
        # DeepSpeed's ZeRO optimizers keep their own fp32 flat copy of the partition even when the model
        # is fp32 (single_partition_of_fp32_groups / fp32_partitioned_groups_flat): measured on the engine.
        b["master_weights"] = 4
    div = {
        "weights": dp if zero_stage >= 3 else 1,
        "gradients": dp if zero_stage >= 2 else 1,
        "master_weights": dp if zero_stage >= 1 else 1,
        "optimizer_states": dp if zero_stage >= 1 else 1,
    }
    return {k: n_params * b[k] / div[k] for k in b}


def layer_saved(sh: ModelShape, tp: int, sp: bool, w_bytes: int = 2, micro_batch: int = 1, flash_gqa: bool = False,
                document_mask: bool = False, cp: int = 1, ring: bool = False) -> tuple[float, float, float]:
    """Working-dtype elements per token that one block of the platform's model (rayspeed.model.transformer,
    eager autograd) keeps for backward without recomputation: (total, attention sub-block, MLP sub-block). Counted
    tensor by tensor and checked against what autograd saves (tests/planner/test_activation_memory.py, CPU).
    r = 4 / w_bytes: an fp32 element in working elements.
    Per RMSNorm, outside the tp region (split only by sequence parallel): the fp32 upcast (in fp32, x.float() is the
    input itself: r h either way), the normalised tensor, the weighted output that feeds the projections, and the
    fp32 rsqrt per row: (r + 2) h + r.
    Attention, inside (split by tp): q after RoPE, k and v as SDPA gets them (expanded to q's width by
    repeat_interleave unless the CUDA flash kernel indexes the kv heads itself: `flash_gqa`, half precision without
    a document mask), the SDPA output, which is also wo's input (the transpose back is a view), the fp32 log-sum-exp
    (r per head); RoPE's fp32 cos and sin tables ([s, head_dim] each, per block, shared by the micro-batch); a
    qk-norm family's q and k norms ((r + 1) x width + r per head each); with document masking the [b, 1, s, s] mask
    SDPA saves (as a working-dtype tensor), built in each block (s per token, not split by tp); without it, a
    sliding-window layer's [1, 1, s, s] mask (s / micro-batch per token; averaged over the layers).
    A norm whose weight multiplies the fp32 normalised tensor (OLMo 2's, Gemma's (1 + w)) keeps that tensor in fp32;
    Gemma's post-norms keep their fp32 input and normalised tensor (2r h + r each). Soft-capped attention (Gemma 2)
    materialises its scores: (2 + r) heads x s per token in half precision, 2 heads x s in fp32, plus the mask.
    MLP: SwiGLU's (or GeGLU's) gate, its activation, up and product (4f).
    Flash/SDPA attention keeps no s x s score matrix (the playbook's 5as/h term is gone).
    Context parallelism (cp > 1; per token of this rank's s / cp): Ulysses runs the same attention on the whole
    sequence for heads / cp, so every term is the same except a mask, which covers the whole sequence: cp times
    larger. Ring attention runs blockwise math attention (model/attention.py ring_attention): each of the cp steps
    keeps the received k and v expanded to q's heads, the fp32 scores of the block and their exponentials, the
    block output and its log-sum-exp, and the block's boolean mask.
    A mask bigger than MASK_TILE_BYTES is built per tile of query rows under a checkpoint (tiled_fraction): such a
    layer keeps q, k, v and the output only."""
    r = 4 / w_bytes
    out_div = tp if sp else 1
    kv_eff = sh.kv_dim if flash_gqa else sh.q_dim
    names = sh.family.tensor_names
    fp32_weight = sh.family.norms_keep_fp32  # the weight multiplies the fp32 normalised tensor before the cast
    # Such a norm keeps its fp32 input and fp32 normalised tensor; its output feeds the projections (or, for a
    # post-norm, OLMo 2's, the branch's input is the residual stream, which they keep): (2r + 1) h + r.
    norm = (((2 * r + 1) if fp32_weight else (r + 2)) * sh.hidden_size + r) / out_div
    extra_norms = names.hidden_norms - 2  # Gemma's post-norms, one per branch
    post_norm = (2 * r * sh.hidden_size + r) / out_div if extra_norms else 0.0
    frac = tiled_fraction(sh, micro_batch, document_mask, ring)
    sdpa = (2 * sh.q_dim + 2 * kv_eff + r * sh.num_heads) / tp
    # A tiled layer's checkpoint keeps q, k and v as they are and the output; its masks, scores, expanded k/v and
    # log-sum-exp are rebuilt in backward.
    sdpa = frac * (2 * sh.q_dim + 2 * sh.kv_dim) / tp + (1 - frac) * sdpa
    attn = norm + sdpa + 2 * r * sh.head_dim / max(1, micro_batch)
    mask_scale = (cp if cp > 1 and not ring else 1) * (0 if frac else 1)
    if ring and cp > 1:
        attn += (cp * (3 * sh.q_dim + r * sh.num_heads) + (r + 1) * sh.num_heads * sh.seq_len) / tp - 2 * kv_eff / tp
        attn += sh.seq_len / w_bytes
        mask_scale = 0
    if names.qk_norm:  # the fp32 upcast, the normalised tensor (fp32 in the fp32-weight order), an rsqrt per row
        rows = (sh.num_heads + sh.num_kv_heads) / tp if names.qk_norm == QK_NORM_PER_HEAD else 2
        attn += ((2 * r) if fp32_weight else (r + 1)) * (sh.q_dim + sh.kv_dim) / tp + r * rows
    if sh.math_attention and not frac:
        # Soft-capped scores run the math path (model/attention.py softcapped_attention): it keeps the tanh
        # output and the probabilities per head and key (working dtype; the fp32 softmax output too in half
        # precision), the boolean mask masked_fill saves, and no log-sum-exp.
        attn += (2 + (r if r != 1 else 0)) * sh.num_heads / tp * sh.seq_len - r * sh.num_heads / tp
        attn += mask_scale * sh.seq_len / (1 if document_mask else max(1, micro_batch)) / w_bytes
    elif document_mask:
        attn += mask_scale * sh.seq_len
    else:
        attn += mask_scale * sh.windowed_layers / sh.num_layers * sh.seq_len / max(1, micro_batch)
    attn += post_norm
    mlp = norm + 4 * sh.ffn_hidden_size / tp + post_norm
    return attn + mlp, attn, mlp


def tiled_fraction(sh: ModelShape, micro_batch: int, document_mask: bool, ring: bool = False) -> float:
    """The share of layers whose mask model/attention.py masked_attention builds a tile at a time: every layer with
    documents, the windowed ones without, once a whole mask (micro-batch or 1 x s x s bytes) would pass
    MASK_TILE_BYTES. (A ring block's mask is per block pair and is built whole.)"""
    if ring or not (document_mask or sh.windowed_layers):
        return 0.0
    if (micro_batch if document_mask else 1) * sh.seq_len * sh.seq_len <= MASK_TILE_BYTES:
        return 0.0
    return 1.0 if document_mask else sh.windowed_layers / sh.num_layers


def block_saved(ctx: Ctx, lay: Layout) -> tuple[float, float, float]:
    """layer_saved for this job's precision, kernels and masking at this layout."""
    flash = (ctx.hw.is_gpu and ctx.precision in ("bf16", "fp16") and not ctx.document_masking
             and not ctx.shape.windowed_layers and not ctx.shape.math_attention)
    ring = lay.cp > 1 and cp_scheme(ctx, lay) == "ring"
    return layer_saved(ctx.shape, lay.tp, lay.sequence_parallel, ctx.w_bytes, lay.micro_batch_size, flash,
                       ctx.document_masking, lay.cp, ring)


def cp_scheme(ctx: Ctx, lay: Layout) -> str:
    """The attention scheme this layout's cp runs (parallel.cp_scheme, auto resolved by the heads rule)."""
    sh = ctx.shape
    return scheme_for(sh.num_heads, sh.num_kv_heads, lay.tp, lay.cp, ctx.cp_scheme)


def micro_batches_in_flight(lay: Layout, stage: int) -> int:
    """Micro-batches whose forward graph a rank of `stage` holds at once: DeepSpeed's 1F1B TrainSchedule runs
    pp - stage forwards before its first backward (at most the step's micro-batches), then alternates. Pinned to
    the schedule itself in tests/planner/test_activation_memory.py, measured by scripts/bench_pipeline_memory.py."""
    return 1 if lay.pp == 1 else min(lay.pp - stage, lay.grad_accum)


def activation_bytes(ctx: Ctx, lay: Layout, stage: int) -> float:
    """Activations held by one rank of `stage` at the peak of backward."""
    sh = ctx.shape
    tokens = local_tokens(sh, lay)
    out_div = lay.tp if lay.sequence_parallel else 1
    full, attn, mlp = block_saved(ctx, lay)
    mode = lay.activation_checkpointing
    if mode == "none":
        kept, working = full, 0.0
    elif mode == "selective":  # attention and MLP sub-blocks checkpointed: their inputs are kept
        kept, working = 2 * sh.hidden_size / out_div, max(attn, mlp * mlp_tile_fraction(ctx, lay, tokens))
    else:  # full: only each block's input is kept; one block is rebuilt at a time
        kept, working = sh.hidden_size / out_div, full
    layers = split_of(sh, lay)[stage]
    in_flight = micro_batches_in_flight(lay, stage)
    # Backward transient: gradients of one block's widest tensors (SwiGLU gate/up, the residual).
    transient = 2 * sh.ffn_hidden_size / lay.tp + 2 * sh.hidden_size
    pipe = 0.0
    if lay.pp > 1:
        # DeepSpeed 0.19.8's PipelineEngine (runtime/pipe/engine.py): per in-flight micro-batch an input (a clone
        # of the receive buffer) and the output that carries the graph, a stage's hidden state each; one receive
        # buffer shared by activations and gradients on every stage but the first; the last stage's backward
        # returns before freeing its outputs, so two old outputs stay alive there.
        pipe = (2 * in_flight + (1 if stage > 0 else 0) + (2 if stage == lay.pp - 1 else 0)) * sh.hidden_size / out_div
    kept += activation_elems_per_token(ctx, lay)
    elems = tokens * (in_flight * layers * kept + working + transient + pipe)
    return elems * ctx.w_bytes


def mlp_tile_fraction(ctx: Ctx, lay: Layout, tokens: float) -> float:
    """The share of the rank's rows whose MLP intermediates backward rebuilds at once under selective checkpointing:
    1, or one tile's when the whole would pass MLP_TILE_BYTES (model/parts/mlp.py mlp_tile_rows; a dense MLP)."""
    sh = ctx.shape
    whole = tokens * 4 * sh.ffn_hidden_size / lay.tp * ctx.w_bytes
    if sh.num_experts or whole <= MLP_TILE_BYTES:
        return 1.0
    return MLP_TILE_BYTES / whole


LOSS_CHUNK_ELEMENTS = 1 << 26  # rayspeed.parallel.loss: largest fp32 logits block of the chunked loss


def logits_bytes(ctx: Ctx, lay: Layout, stage: int) -> float:
    """Last stage only: the output head's loss buffers (rayspeed.parallel.loss). The chunked cross-entropy never
    builds full logits, at any tp: one chunk of fp32 logits of this rank's vocabulary slice (v / tp), its
    probabilities and gradient (about 10 bytes per element of a 2^26-element chunk), plus the head's fp32
    weight-gradient accumulator (4 v h / tp)."""
    if stage != lay.pp - 1:
        return 0.0
    sh = ctx.shape
    vocab = sh.vocab_size / lay.tp
    return min(local_tokens(sh, lay) * vocab, LOSS_CHUNK_ELEMENTS) * (ctx.w_bytes + 8) + 4 * vocab * sh.hidden_size


def buckets(ctx: Ctx, lay: Layout) -> dict:
    """DeepSpeed bucket sizes (elements), from the hidden size like the HF integration's "auto"
    (h^2 reduce/all-gather buckets, 0.9 h^2 prefetch, 10h persistence threshold), clamped so that small
    models still send a few large messages and large ones do not reserve gigabytes."""
    n0 = split_of(ctx.shape, lay)[0]
    key = ("buckets", lay.tp, lay.pp, n0, lay.ep)
    got = ctx.memo.get(key)
    if got is None:
        got = ctx.memo[key] = _buckets(ctx, lay, n0)
    return got


def _buckets(ctx: Ctx, lay: Layout, n0: int) -> dict:
    sh = ctx.shape
    n = stage_params(sh, lay.tp, lay.pp, 0, n0, lay.ep)
    bucket = int(min(max(sh.hidden_size * sh.hidden_size, 2**23), 5e8, max(n, 1)))
    bucket = -(-bucket // 64) * 64  # ZeRO-1/2 want a multiple of their alignment (2 elements); a tiny model's n is odd
    layer_elems = sh.layer_matrix_params // lay.tp
    return {
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "stage3_prefetch_bucket_size": int(0.9 * bucket),
        "stage3_param_persistence_threshold": 10 * sh.hidden_size,
        "stage3_max_live_parameters": int(max(2 * layer_elems, bucket)),
        "stage3_max_reuse_distance": int(max(2 * layer_elems, bucket)),
    }


def bucket_bytes(ctx: Ctx, lay: Layout) -> float:
    b = buckets(ctx, lay)
    if lay.zero_ranks == 1 and lay.zero_stage < 3:
        return 0.0
    if lay.zero_stage == 0:
        return b["reduce_bucket_size"] * ctx.comm_bytes
    if lay.zero_stage in (1, 2):
        if not ctx.hw.is_gpu:  # overlap_comm is off on CPU: one reduce and one gather bucket
            return b["reduce_bucket_size"] * ctx.comm_bytes + b["allgather_bucket_size"] * ctx.w_bytes
        # DeepSpeed: overlap_comm "uses 4.5x the allgather_bucket_size and reduce_bucket_size values" (stated for
        # 2-byte elements); the reduce side's buffers are in the communication dtype (fp32 here: the ipg
        # buckets are keyed by communication_data_type in stage_1_and_2).
        return 4.5 * (b["reduce_bucket_size"] * ctx.comm_bytes + b["allgather_bucket_size"] * ctx.w_bytes)
    return 2 * b["reduce_bucket_size"] * ctx.comm_bytes


def zero3_gathered_bytes(ctx: Ctx, lay: Layout, stage: int) -> float:
    """ZeRO-3: full (tp-split) parameters of the modules in use plus those prefetched, plus ZeRO++'s
    node-local secondary weight partition when hierarchical partitioning is on."""
    if lay.zero_stage < 3:
        return 0.0
    sh = ctx.shape
    b = buckets(ctx, lay)
    biggest = sh.layer_matrix_params / lay.tp
    if stage == 0 or stage == lay.pp - 1:
        biggest = max(biggest, sh.vocab_size * sh.hidden_size / lay.tp)
    live = (min(b["stage3_max_live_parameters"], 2 * biggest) + b["stage3_prefetch_bucket_size"]) * ctx.w_bytes
    n = stage_params(sh, lay.tp, lay.pp, stage, split_of(sh, lay)[stage], lay.ep)
    secondary = n * ctx.w_bytes / lay.hpz if lay.hpz > 1 else 0.0
    return live + secondary


def communicators(lay: Layout) -> int:
    """NCCL communicators a rank initialises: the world (DeepSpeed's engine group), dp, tp, cp, and pp's two
    neighbour pairs (the pipeline engine's p2p groups)."""
    if lay.world_size <= 1:
        return 0
    # Under cp also the cp group and the dp x cp group ZeRO reduces over.
    groups = (lay.dp, lay.tp, lay.cp, lay.zero_ranks if lay.cp > 1 else 1)
    return 1 + sum(1 for d in groups if d > 1) + (2 if lay.pp > 1 else 0)


def stage_breakdown(ctx: Ctx, lay: Layout, stage: int) -> dict:
    """Bytes per component for one rank of `stage`."""
    ctx, lay = ctx.in_rows(lay)
    layers = split_of(ctx.shape, lay)[stage]
    trained, frozen = trained_and_frozen(ctx, lay, stage, layers)
    out = model_state_bytes(round(trained), ctx.precision, ctx.grad_accum_dtype, lay.zero_stage, lay.zero_ranks)
    if frozen:  # an adapter job's base: its weights only, 4-bit ones under QLoRA (planner/adapter_terms.py)
        out["weights"] += frozen_weight_bytes(ctx, lay, layers, frozen)
    out["activations"] = activation_bytes(ctx, lay, stage)
    out["logits_loss"] = logits_bytes(ctx, lay, stage)
    out["zero3_gathered"] = zero3_gathered_bytes(ctx, lay, stage)
    out["comm_buckets"] = bucket_bytes(ctx, lay)
    if ctx.hw.is_gpu:
        # CUDA context + cuBLAS workspaces (0.75 GiB), and per NCCL communicator its channel buffers:
        # NCCL_BUFFSIZE (4 MiB) x up to 32 channels x send + receive = 0.25 GiB.
        out["cuda_context"] = (0.75 + 0.25 * communicators(lay)) * GIB
    else:
        out["cuda_context"] = 0.4 * GIB  # the Python + torch process itself
    dynamic = out["activations"] + out["logits_loss"] + out["zero3_gathered"] + out["comm_buckets"]
    for name, (nbytes, churns) in memory_terms(ctx, lay, stage).items():  # what features add (planner/terms.py)
        out[name] = nbytes
        dynamic += nbytes if churns else 0.0
    # Caching-allocator fragmentation grows with the churn of short-lived tensors.
    out["allocator_slack"] = 0.25 * GIB + 0.05 * dynamic
    return out


def worst_stage(ctx: Ctx, lay: Layout) -> tuple[int, dict]:
    """(stage, bytes by component) of the rank with the largest total. The first stage holds the most
    in-flight micro-batches and the embedding, the last the head and the logits; with an uneven split a
    middle stage may hold the most, so every stage whose (blocks, in-flight) pair is new is costed."""
    split = split_of(ctx.shape, lay)
    # Everything else equal, an earlier stage holds more in-flight micro-batches: per block count only the
    # earliest middle stage can be the worst.
    seen: set = set()
    stages = []
    for st, n in enumerate(split):
        key = (n, st == 0, st == lay.pp - 1)
        if key not in seen:
            seen.add(key)
            stages.append(st)
    breakdowns = {st: stage_breakdown(ctx, lay, st) for st in stages}
    worst = max(stages, key=lambda st: sum(breakdowns[st].values()))  # the first of equal totals
    return worst, breakdowns[worst]


def to_gib(br: dict) -> dict:
    return {k: round(v / GIB, 3) for k, v in br.items()}
