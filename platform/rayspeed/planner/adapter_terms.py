"""What adapters change in the memory and time of a step (docs/PLANNER.md, "Adapters").

Memory per rank: the frozen base keeps only its weights (in the working dtype; ZeRO-3 shards them over dp; no
gradient, fp32 master or Adam state), what trains (the adapters and any module `trainable` names) keeps the full
16 (or 20) bytes per parameter of playbook part A, divided by ZeRO as usual; the base's activations are kept as
without adapters, plus per adapted layer and token the rank-r product A x (and, with dropout, the dropped input)
when nothing is recomputed.

Time: a frozen layer's backward computes the input gradient only (one GEMM where training computes two: the
weight gradient is skipped), the adapter adds two thin GEMMs forward (x A^T, then (A x) B^T) and four backward;
DoRA also reads the whole base weight for its row norms each forward (an element-wise pass over W and B A).
Data parallelism reduces and gathers only what trains; ZeRO-3 still gathers the frozen base.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rayspeed.config import adapter as spec
from rayspeed.planner.model_math import local_tokens, stage_params
from rayspeed.planner.terms import MemoryTerm, register

NF4_BLOCK = 64
"""Elements per NF4 block, each block with one scale (bitsandbytes' blocksize)."""


@dataclass(frozen=True)
class AdapterPlan:
    rank: int
    roles: tuple[str, ...]
    dora: bool
    dropout: bool
    full: tuple[str, ...]  # modules trained in full: embed, head, norms
    flops_per_token: float  # the job's model FLOPs per token (config.adapter.flops_per_token)
    nf4: bool = False  # QLoRA: the blocks' linear weights packed in 4 bits
    double_quant: bool = True
    compute_bytes: Optional[int] = None  # bytes per element of the dequantized weight (None: the working dtype's)
    ranks: tuple[int, ...] = ()  # per role of `roles` (model.adapter.rank_pattern over rank); () : rank for all
    shared_a: tuple[str, ...] = ()  # roles whose adapter uses an earlier part's A (fused projections)
    mlp_share: float = 1.0  # the blocks with a dense MLP (a mixture of experts' MoE blocks adapt attention only)

    def rank_of(self, role: str) -> int:
        return self.ranks[self.roles.index(role)] if self.ranks else self.rank

    def share(self, role: str) -> float:
        """The fraction of blocks that have `role`'s layer (an average over a stage's blocks for the MLP roles)."""
        return self.mlp_share if role in spec.MLP_ROLES else 1.0

    @classmethod
    def of(cls, adapter: Any, shape: Any) -> Optional["AdapterPlan"]:
        if not spec.enabled(adapter):
            return None
        nf4 = getattr(adapter, "base_precision", "auto") == "nf4"
        compute = getattr(adapter, "compute_dtype", "auto")
        return cls(rank=adapter.rank, roles=spec.target_roles(adapter), dora=adapter.dora,
                   dropout=adapter.dropout > 0, full=tuple(adapter.trainable),
                   flops_per_token=spec.flops_per_token(shape, adapter), nf4=nf4,
                   ranks=tuple(spec.role_rank(adapter, r) for r in spec.target_roles(adapter)),
                   shared_a=tuple(r for r in spec.target_roles(adapter) if spec.shares_a(r, shape.family)),
                   double_quant=bool(getattr(adapter, "double_quant", True)),
                   mlp_share=spec.role_layers(shape, "gate") / shape.num_layers,
                   compute_bytes=None if compute == "auto" else (4 if compute == "fp32" else 2))


def layer_adapter_params(sh: Any, ap: AdapterPlan, tp: int) -> float:
    """Adapter elements of one block on one tp rank: a column layer's A whole and B split, a row layer's A split
    and B whole (rayspeed.adapters.lora), DoRA's magnitude split like the output."""
    n = 0.0
    for role in ap.roles:
        i, o = spec.role_dims(sh)[role]
        column = role in spec.COLUMN_ROLES
        r = ap.rank_of(role)
        if role in ap.shared_a:  # a later part of a fused projection: its rows of B only
            i = 0
        m = r * (i + o / tp) if column else r * (i / tp + o)
        if ap.dora:
            m += o / tp if column else o
        n += ap.share(role) * m
    return n


def full_trained_params(sh: Any, ap: AdapterPlan, lay: Any, stage: int, layers: int) -> float:
    n = 0.0
    if "embed" in ap.full and stage == 0:
        n += sh.embedding_params / lay.tp
    if "head" in ap.full and stage == lay.pp - 1 and (not sh.tie_embeddings or lay.pp > 1 or "embed" not in ap.full):
        n += sh.vocab_size * sh.hidden_size / lay.tp
    if "norms" in ap.full:
        n += layers * sh.layer_norm_params + (sh.hidden_size if stage == lay.pp - 1 else 0)
    return n


def trained_and_frozen(ctx: Any, lay: Any, stage: int, layers: int, n_stage: Optional[float] = None
                       ) -> tuple[float, float]:
    """(parameters that train, frozen parameters) of one rank of `stage` holding `layers` blocks (of n_stage
    parameters in all; None: that stage's own count)."""
    if n_stage is None:
        n_stage = stage_params(ctx.shape, lay.tp, lay.pp, stage, layers, lay.ep)
    ap = ctx.adapter
    if ap is None:
        return n_stage, 0.0
    full = full_trained_params(ctx.shape, ap, lay, stage, layers)
    return layers * layer_adapter_params(ctx.shape, ap, lay.tp) + full, max(0.0, n_stage - full)


def activation_elems_per_token(ctx: Any, lay: Any) -> float:
    """Working-dtype elements per token and block the adapters save for backward (nothing recomputed): A x (rank)
    per adapted layer, and with dropout the dropped input and its mask."""
    ap = ctx.adapter
    if ap is None or lay.activation_checkpointing != "none":
        return 0.0
    dims = spec.role_dims(ctx.shape)
    n = 0.0
    for role in ap.roles:
        i, _ = dims[role]
        n += ap.share(role) * (ap.rank_of(role)
                               + (2 * i / (1 if role in spec.COLUMN_ROLES else lay.tp) if ap.dropout else 0.0))
    return n


def gemm_seconds(ctx: Any, lay: Any, gemm_s: Any, dense_fwd: float) -> tuple[float, float]:
    """(forward, backward) GEMM seconds of one block for one micro-batch with adapters, given the dense forward
    GEMMs `dense_fwd` (the base's): the base's backward is its input gradient only, the adapters' GEMMs added
    (gemm_s: the time model's GEMM time)."""
    ap = ctx.adapter
    if ap is None:
        return dense_fwd, 2 * dense_fwd
    sh, t = ctx.shape, lay.tp
    T = local_tokens(sh, lay)
    fwd = 0.0
    for role in ap.roles:
        i, o = spec.role_dims(sh)[role]
        column = role in spec.COLUMN_ROLES
        r = ap.rank_of(role)
        fwd += ap.share(role) * (gemm_s(ctx, T, i if column else i / t, r) + gemm_s(ctx, T, r, o / t if column else o))
    return dense_fwd + fwd, dense_fwd + 2 * fwd


# ---------------------------------------------------------------- QLoRA: the base's linear weights in 4 bits


def linear_weights(sh: Any, tp: int) -> float:
    """Weight elements of one block's seven linear layers on one tp rank (every one packed under nf4, adapted
    or not; biases, norms, embeddings and the head stay in the working dtype)."""
    return sum(i * o for i, o in spec.role_dims(sh).values()) / tp


def nf4_bytes_per_weight(ap: AdapterPlan, tp: int) -> float:
    """Half a byte of code per weight plus its block's scale: 8 bits per 64 weights with double quantization (and
    its own fp32 scale per 256 blocks), fp32 per 64 without it; under tensor parallelism rayspeed.adapters.nf4
    keeps each rank's scales in fp32 (exactly the whole matrix's double-quantized values)."""
    if ap.double_quant and tp == 1:
        return 0.5 + 1.0 / NF4_BLOCK + 4.0 / (NF4_BLOCK * 256)
    return 0.5 + 4.0 / NF4_BLOCK


def frozen_weight_bytes(ctx: Any, lay: Any, layers: int, frozen: float) -> float:
    """Bytes of one rank's frozen parameters (`frozen` of them, `layers` blocks): the working dtype, ZeRO-3
    sharding them over dp; with nf4 the blocks' linear weights at nf4_bytes_per_weight."""
    ap = ctx.adapter
    if ap is None or not ap.nf4:
        return frozen * ctx.w_bytes / (lay.zero_ranks if lay.zero_stage == 3 else 1)
    packed = min(frozen, layers * linear_weights(ctx.shape, lay.tp))
    return packed * nf4_bytes_per_weight(ap, lay.tp) + (frozen - packed) * ctx.w_bytes


def compute_bytes(ctx: Any) -> int:
    ap = ctx.adapter
    return ap.compute_bytes if ap is not None and ap.compute_bytes else ctx.w_bytes


def dequant_bytes(ctx: Any, lay: Any) -> float:
    """Memory traffic of dequantizing one block's packed weights once (read the codes and scales, write the dense
    weight): every forward, every backward (the input gradient needs W again) and every recomputed forward."""
    ap = ctx.adapter
    if ap is None or not ap.nf4:
        return 0.0
    return linear_weights(ctx.shape, lay.tp) * (nf4_bytes_per_weight(ap, lay.tp) + compute_bytes(ctx))


def _dequantized_bytes(ctx: Any, lay: Any, stage: int) -> float:
    """The one dense weight alive at a time while a packed layer computes (the largest of a block)."""
    return max(i * o for i, o in spec.role_dims(ctx.shape).values()) / lay.tp * compute_bytes(ctx)


register(MemoryTerm("nf4_dequantized", applies=lambda ctx, lay: ctx.adapter is not None and ctx.adapter.nf4,
                    bytes=_dequantized_bytes, source="docs/PLANNER.md, Adapters: QLoRA"))
