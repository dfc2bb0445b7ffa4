"""Decoder-only transformer (Llama-style: RMSNorm, GQA with RoPE, SwiGLU; q/k/v biases for Qwen2-style shapes).

The same function as transformers' LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM for the shapes
rayspeed.config.hf_config accepts (rotate-half RoPE, RMSNorm in fp32, llama3 and linear RoPE scaling), and the
parts other families' blocks (model/<family>_block.py) share: the norm styles, sliding-window layers with their own
RoPE base, a custom attention scale, GeGLU, a scaled embedding.

One model for every layout: pass a TensorParallel handle to split heads, the MLP and the
vocabulary over a tp group, and sequence_parallel=True to also split the norm / residual
regions along the sequence. Weights are initialised from (seed, parameter name) on the full
tensor, so every layout of the same seed starts from the same function and produces the
same loss (see parallel/layers.py).
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rayspeed.config.shape import ModelShape
from rayspeed.config.validate import shape_split_problems
from rayspeed.families.family import NORM_RMS, NORM_RMS_FP32_WEIGHT, NORM_RMS_OFFSET, NORM_STYLES
from rayspeed.model.attention import MaskRows, context_attention, masked_attention
from rayspeed.model.flex import flex_attention
from rayspeed.model.moe import MoE, RouterStats
from rayspeed.model.output import ModelOutput, Routing
from rayspeed.model.rope import apply_rope, rope_tables
from rayspeed.parallel.comm import copy_to_tp, gather_from_tp
from rayspeed.parallel.context_parallel import NO_CP, ContextParallel, SequenceLayout, segment_positions, sum_over_cp
from rayspeed.parallel.groups import TensorParallel
from rayspeed.parallel.layers import (
    NO_TP,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    enter_tp_region,
    gather_full,
    sharded_parameter,
)
from rayspeed.parallel.loss import IGNORE_INDEX, linear_cross_entropy, softcap

CHECKPOINTING_MODES = ("none", "selective", "full")


def check_split(shape: ModelShape, tp: TensorParallel, sequence_parallel: bool) -> None:
    """Raise ValueError when this shape cannot be split over this tp group (the job checks say the same in
    config terms before anything starts; this guards direct library use)."""
    problems = shape_split_problems(shape, tp.world_size, sequence_parallel)
    if problems:
        raise ValueError("invalid model for this layout: " + "; ".join(problems))


def check_mode(activation_checkpointing: str) -> str:
    if activation_checkpointing not in CHECKPOINTING_MODES:
        raise ValueError(f"activation_checkpointing must be one of {CHECKPOINTING_MODES}, "
                         f"got {activation_checkpointing!r}")
    return activation_checkpointing


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32. The weight is replicated across tp. `style` (families.family.NORM_STYLES): where
    the weight is applied, after the cast back (Llama), before it (OLMo 2), or as (1 + weight) before it, starting
    at 0 (Gemma): each as transformers computes it, so half precision rounds the same way.

    Under sequence parallelism each rank normalises only its sequence shard, so its weight
    gradient is a partial sum: routing the weight through f (identity forward, all-reduce
    backward) makes every rank see the full-sequence gradient.
    """

    def __init__(self, dim: int, eps: float = 1e-5, tp: Optional[TensorParallel] = None,
                 sequence_parallel: bool = False, style: str = NORM_RMS):
        super().__init__()
        if style not in NORM_STYLES:
            raise ValueError(f"norm style {style!r} is not one of {NORM_STYLES}")
        self.tp = tp or NO_TP
        self.eps, self.style = eps, style
        self.sequence_parallel = sequence_parallel and self.tp.enabled
        self.weight = nn.Parameter(torch.zeros(dim) if style == NORM_RMS_OFFSET else torch.ones(dim))
        if self.sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tp(self.weight, self.tp) if self.sequence_parallel else self.weight
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if self.style == NORM_RMS_OFFSET:
            return (normed * (1.0 + weight.float())).type_as(x)
        if self.style == NORM_RMS_FP32_WEIGHT:
            return (weight * normed).to(x.dtype)
        return normed.type_as(x) * weight


class Attention(nn.Module):
    """Causal grouped-query attention; heads and kv-heads are split evenly over tp.

    Rank r owns query heads [r*a/tp, ...) and kv heads [r*kv/tp, ...); because both splits
    are contiguous and a/kv is a whole number, local query head i still uses local kv head
    i // (a/kv), so no kv head is needed on more than one rank.
    """

    def __init__(self, dims: ModelShape, tp: TensorParallel, sequence_parallel: bool, seed: int, name: str,
                 layer_idx: int = 0):
        super().__init__()
        self.tp, self.sequence_parallel = tp, sequence_parallel
        h, hd = dims.hidden_size, dims.head_dim
        self.head_dim, self.rotary_dim = hd, dims.rotary_dim
        self.local_heads = dims.num_heads // tp.world_size
        self.local_kv_heads = dims.num_kv_heads // tp.world_size
        self.window, self.scale = dims.window_of(layer_idx), dims.attention_scale
        self.cap = dims.attn_logit_softcapping
        self.flex = dims.attention_kernel == "flex"  # masked or soft-capped layers through FlexAttention on CUDA
        # A local layer with its own base has plain RoPE (rope_dims None); every other one the shape's scaling.
        self.rope_theta, scaled = dims.rope_of(layer_idx)
        self.rope_dims: Optional[ModelShape] = dims if scaled else None
        col = dict(tp=tp, shared_input=True, init_std=dims.init_std, seed=seed, bias=dims.qkv_bias)
        self.wq = ColumnParallelLinear(h, dims.num_heads * hd, name=f"{name}.wq", **col)
        self.wk = ColumnParallelLinear(h, dims.num_kv_heads * hd, name=f"{name}.wk", **col)
        self.wv = ColumnParallelLinear(h, dims.num_kv_heads * hd, name=f"{name}.wv", **col)
        self.wo = RowParallelLinear(
            dims.num_heads * hd, h, tp, input_is_parallel=True, sequence_parallel=sequence_parallel,
            init_std=dims.residual_init_std, seed=seed, name=f"{name}.wo",
        )

    def normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [b, heads, s, head_dim] before RoPE: as they are here; a family's block may normalise them."""
        return q, k

    def forward(self, x: torch.Tensor, segment_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """segment_ids [b, s] (the full sequence, also under sequence parallelism): attention stays within a
        document and positions restart at each one."""
        x = enter_tp_region(x, self.tp, self.sequence_parallel)  # one collective for q, k and v
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.normed(q, k)
        if isinstance(segment_ids, SequenceLayout):  # context parallel: this rank holds a part of the sequence
            cos, sin = rope_tables(s, self.rotary_dim, self.rope_theta, device=x.device, dims=self.rope_dims,
                                   positions=segment_ids.rope_positions)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            out = context_attention(q, k, v, segment_ids, self.window, self.scale, self.cap)
            return self.wo(out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))
        positions = None if segment_ids is None else segment_positions(segment_ids)
        cos, sin = rope_tables(s, self.rotary_dim, self.rope_theta, device=x.device, dims=self.rope_dims,
                               positions=positions)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rows = MaskRows.of(s, segment_ids, self.window, x.device)
        # (On CPU FlexAttention has a forward only: used there without autograd, as the parity tests compare it.)
        if self.flex and (q.is_cuda or not torch.is_grad_enabled()) and (rows is not None or self.cap):
            out = flex_attention(q, k, v, rows, self.scale, self.cap)
        else:
            out = masked_attention(q, k, v, rows, self.scale, self.cap)
        out = out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        return self.wo(out)


class MLP(nn.Module):
    """SwiGLU: w_down(silu(w_gate x) * w_up x), or GeGLU with the tanh GELU (Gemma); gate/up split by columns,
    down by rows."""

    def __init__(self, dims: ModelShape, tp: TensorParallel, sequence_parallel: bool, seed: int, name: str):
        super().__init__()
        self.tp, self.sequence_parallel = tp, sequence_parallel
        h, f = dims.hidden_size, dims.ffn_hidden_size
        self.gelu = dims.hidden_act == "gelu_pytorch_tanh"
        col = dict(tp=tp, shared_input=True, init_std=dims.init_std, seed=seed)
        self.w_gate = ColumnParallelLinear(h, f, name=f"{name}.w_gate", **col)
        self.w_up = ColumnParallelLinear(h, f, name=f"{name}.w_up", **col)
        self.w_down = RowParallelLinear(
            f, h, tp, input_is_parallel=True, sequence_parallel=sequence_parallel,
            init_std=dims.residual_init_std, seed=seed, name=f"{name}.w_down",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_tp_region(x, self.tp, self.sequence_parallel)
        gate = self.w_gate(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.w_down(gate * self.w_up(x))


# planner/memory.py MLP_TILE_BYTES: a dense MLP whose intermediates (gate, its activation, up, the product) would
# pass this for the rank's rows is recomputed a tile of rows at a time under selective checkpointing.
MLP_TILE_BYTES = 1 << 28


def mlp_tile_rows(mlp: nn.Module, x: torch.Tensor) -> Optional[int]:
    """Rows (of dim 1, this rank's sequence) per MLP tile, or None: one piece (small, or a mixture of experts)."""
    if not isinstance(mlp, MLP):
        return None
    gathered = mlp.tp.world_size if (mlp.sequence_parallel and mlp.tp.enabled) else 1  # rows each tile gathers
    per_row = x.shape[0] * gathered * (mlp.w_gate.out_features // mlp.tp.world_size) * 4 * x.element_size()
    if per_row * x.shape[1] <= MLP_TILE_BYTES:
        return None
    return max(1, MLP_TILE_BYTES // per_row)


class Block(nn.Module):
    """Pre-norm transformer block. Parameter names are `layers.{layer_idx}.*` wherever it lives.

    activation_checkpointing: "selective" recomputes the attention and MLP sub-blocks
    (norm included) in backward, "full" the whole block; both non-reentrant.
    A family's block (model/<family>_block.py) names its own attention or norm class here.
    """

    attention_class: type = Attention
    norm_class: type = RMSNorm

    def __init__(
        self,
        cfg,
        layer_idx: int,
        tp: Optional[TensorParallel] = None,
        sequence_parallel: bool = False,
        activation_checkpointing: str = "none",
        preserve_rng_state: bool = False,
        seed: int = 0,
    ):
        super().__init__()
        dims = ModelShape.from_config(cfg)
        tp = tp or NO_TP
        sp = sequence_parallel and tp.enabled
        self.layer_idx = layer_idx
        self.activation_checkpointing = check_mode(activation_checkpointing)
        self.preserve_rng_state = preserve_rng_state
        prefix = f"layers.{layer_idx}"
        self.canonical_prefix = prefix  # where its parameters live in Transformer's state dict
        self.family = dims.family  # its checkpoint's names (the adapters of fused projections share one A)
        self.in_moe_model = dims.num_experts > 0  # adapters leave every MLP of a mixture of experts (config.adapter)
        self.attn_norm = self.norm_class(dims.hidden_size, dims.norm_eps, tp, sp, dims.family.norm)
        self.attn = self.attention_class(dims, tp, sp, seed, name=f"{prefix}.attn", layer_idx=layer_idx)
        self.mlp_norm = self.norm_class(dims.hidden_size, dims.norm_eps, tp, sp, dims.family.norm)
        self.mlp = (MoE(dims, seed, f"{prefix}.mlp", tp=tp, sequence_parallel=sp) if dims.is_moe(layer_idx)
                    else MLP(dims, tp, sp, seed, name=f"{prefix}.mlp"))

    def _checkpointed(self, fn, *args):
        if not torch.is_grad_enabled():  # nothing to recompute without a backward
            return fn(*args)
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng_state)

    def attn_branch(self, x, segment_ids=None):
        return self.attn(self.attn_norm(x), segment_ids)

    def mlp_branch(self, x):
        return self.mlp(self.mlp_norm(x))

    def _block(self, x, segment_ids=None):
        if self.activation_checkpointing == "selective":
            x = x + self._checkpointed(self.attn_branch, x, segment_ids)
            rows = mlp_tile_rows(self.mlp, x) if torch.is_grad_enabled() else None
            if rows is None:
                return x + self._checkpointed(self.mlp_branch, x)
            # A long sequence's MLP in tiles of its rows, each checkpointed alone: backward rebuilds one tile's
            # intermediates at a time, not the whole sequence's 4 f per token (row-wise: the same result).
            return x + torch.cat([self._checkpointed(self.mlp_branch, part) for part in x.split(rows, dim=1)], dim=1)
        x = x + self.attn_branch(x, segment_ids)
        return x + self.mlp_branch(x)

    def forward(self, x, segment_ids: Optional[torch.Tensor] = None):
        """x [b, s(/tp), h]; or, between pipeline stages, the tuple (x, segment_ids), returned as such."""
        if isinstance(x, tuple):
            hidden, seg = x
            return self.forward(hidden, seg), seg
        if self.activation_checkpointing == "full":
            return self._checkpointed(self._block, x, segment_ids)
        return self._block(x, segment_ids)


def block_class(dims: ModelShape) -> type:
    """The block of the shape's family: `Block` above, or the `Block` of the module under rayspeed.model its record
    names (a family whose block differs brings that one module; the Transformer and the pipeline build it)."""
    module = dims.family.block_module
    if module is None:
        return Block
    return importlib.import_module(f"rayspeed.model.{module}").Block


def embed_scale(dims: ModelShape) -> Optional[float]:
    """What the embedding's output is multiplied by: sqrt(hidden) for a family that scales it (Gemma), else None."""
    return math.sqrt(dims.hidden_size) if dims.family.embed_scale else None


class OutputHead(nn.Module):
    """Logits over the (tp-split) vocabulary, optionally reusing the embedding matrix.

    The loss path never builds full logits: tp=1 runs the chunked CE, tp>1 keeps this
    rank's vocab slice and uses the vocab-parallel CE.
    """

    def __init__(
        self,
        cfg,
        tp: Optional[TensorParallel] = None,
        sequence_parallel: bool = False,
        seed: int = 0,
        tied_weight: Optional[nn.Parameter] = None,
        loss_chunk_tokens: Optional[int] = None,
    ):
        super().__init__()
        dims = ModelShape.from_config(cfg)
        self.tp = tp or NO_TP
        self.sequence_parallel = sequence_parallel and self.tp.enabled
        self.chunk_tokens = loss_chunk_tokens
        self.cap = dims.final_logit_softcapping
        self.tied = tied_weight is not None
        if self.tied:
            self.weight = tied_weight  # same Parameter object as the embedding's: shared storage
        else:
            self.weight = sharded_parameter(
                (dims.vocab_size, dims.hidden_size), 0, self.tp, std=dims.init_std, seed=seed, key="head.weight"
            )

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """Full-sequence, tp-region input for the vocab-split matmul."""
        return enter_tp_region(x, self.tp, self.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Full logits [batch, seq, vocab] (gathered over tp): for inference and tests, not training."""
        return softcap(gather_from_tp(F.linear(self.prepare(x), self.weight), self.tp), self.cap)

    def loss(self, x: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return linear_cross_entropy(self.prepare(x), self.weight, labels, self.tp, chunk_tokens=self.chunk_tokens,
                                    cap=self.cap, reduction=reduction)


class Transformer(nn.Module):
    """embed -> N blocks -> RMSNorm -> head. forward(ids, labels) is the mean fp32 CE over the counted labels;
    without labels, logits."""

    def __init__(
        self,
        cfg,
        tp: Optional[TensorParallel] = None,
        sequence_parallel: bool = False,
        activation_checkpointing: str = "none",
        preserve_rng_state: bool = False,
        seed: int = 0,
        loss_chunk_tokens: Optional[int] = None,
        cp: Optional[ContextParallel] = None,
    ):
        super().__init__()
        dims = ModelShape.from_config(cfg)
        tp = tp or NO_TP
        sp = sequence_parallel and tp.enabled
        check_split(dims, tp, sp)
        self.dims, self.tp, self.sequence_parallel, self.seed = dims, tp, sp, seed
        self.cp = cp or NO_CP
        self.activation_checkpointing = check_mode(activation_checkpointing)

        self.embed = VocabParallelEmbedding(
            dims.vocab_size, dims.hidden_size, tp, sequence_parallel=sp, init_std=dims.init_std, seed=seed,
            name="embed", scale=embed_scale(dims),
        )
        self.layers = nn.ModuleList(
            block_class(dims)(dims, i, tp, sp, activation_checkpointing, preserve_rng_state, seed)
            for i in range(dims.num_layers)
        )
        # Every MoE layer reports its routing to one collector: the balance loss pools them all.
        self.router_stats = RouterStats(dims.num_experts, self.cp) if dims.num_experts else None
        for layer in self.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.stats = self.router_stats
        self.routing: Optional[Routing] = None if self.router_stats is None else Routing(
            self.router_stats, [i for i in range(dims.num_layers) if dims.is_moe(i)])
        self.aux_loss: Optional[torch.Tensor] = None  # the last forward's balance loss (moe/aux_loss), unweighted
        self.norm = RMSNorm(dims.hidden_size, dims.norm_eps, tp, sp, dims.family.norm)
        self.head = OutputHead(dims, tp, sp, seed, tied_weight=self.embed.weight if dims.tie_embeddings else None,
                               loss_chunk_tokens=loss_chunk_tokens)
        if dims.tie_embeddings:
            self.register_state_dict_post_hook(_frozen_tied_head_once)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                segment_ids: Optional[torch.Tensor] = None, reduction: str = "mean", parts: bool = False) -> Any:
        """Labels of -100 are not counted (the mean is over the others). segment_ids [b, s]: document masking
        (attention within a document, positions from its start); None: plain causal attention. reduction "none":
        each label's cross entropy [b, s] (0 where not counted; a preference objective's per-token log-probabilities
        negated), without the balance loss. parts: the loss as a ModelOutput (what trains, the language loss, the
        balance loss) instead of the one tensor transformers returns.

        Context parallel (cp): the three are this rank's part of each sequence (context_parallel.py `shard`), the
        logits those of its tokens, and the loss this rank's share of the whole sequence's mean: its tokens' sum
        over the count of every part's labels, so the sum over the cp group (DeepSpeed's gradient reduction over
        data x cp) is the unsplit loss."""
        x = self.embed(input_ids)
        if self.router_stats is not None:
            self.router_stats.start(windowed=self.training and torch.is_grad_enabled())
        where = SequenceLayout(self.cp, input_ids.shape[1], segment_ids, x.device) if self.cp.enabled else segment_ids
        for layer in self.layers:
            x = layer(x, where)
        x = self.norm(x)
        aux = self.router_stats.aux_loss() if self.router_stats is not None else None
        self.aux_loss = aux.detach() if aux is not None else None  # kept for metrics, without the graph
        if labels is None:
            return self.head(x)
        if reduction == "none":
            if self.cp.enabled:
                raise ValueError("per-token losses under context parallelism are not built")
            per_token = self.head.loss(x, labels, reduction="none").view(labels.shape)
            return ModelOutput(per_token, per_token) if parts else per_token
        if self.cp.enabled:
            count = sum_over_cp((labels != IGNORE_INDEX).sum(), self.cp).clamp(min=1)
            language = self.head.loss(x, labels, reduction="sum") / count
        else:
            language = self.head.loss(x, labels)
        # Under cp every part holds the whole sequence's balance loss: each adds its 1/cp share, as the loss's.
        balance = None if aux is None else aux * self.dims.router_aux_loss_coef / self.cp.world_size
        loss = language if balance is None else language + balance
        return ModelOutput(loss, language, balance, self.aux_loss) if parts else loss

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter unsharded (all-gathered over tp; collective), keyed by parameter name.

        For the same seed this is bit-identical for every tp size and equals the weights of
        the same-named layers of the pipeline module.
        """
        return {name: gather_full(p, p, self.tp).clone() for name, p in self.named_parameters()}

    full_state_dict_reference = full_state_dict


def _frozen_tied_head_once(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
    """A frozen tied head is the frozen embedding: a checkpoint that leaves frozen parameters out (an adapter
    job's) must not keep the matrix under its second name."""
    if not module.embed.weight.requires_grad:
        state.pop(prefix + "head.weight", None)


def num_parameters(model: nn.Module) -> int:
    """Parameters held by this process (tied ones once; a tp rank counts only its shards)."""
    return sum(p.numel() for p in model.parameters())


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters held by this process."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def count_parameters(cfg) -> int:
    """Parameters of the whole (unsharded) model, from the config alone."""
    return ModelShape.from_config(cfg).params
