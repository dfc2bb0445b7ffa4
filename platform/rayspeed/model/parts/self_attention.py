"""Causal grouped-query attention with RoPE, document and window masks, soft-capping and context parallelism, and
the q/k-norm variants families compose: per head (Qwen3, Gemma 3; the family's norm class) and over the whole
projections (OLMo 2)."""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn

from rayspeed.config.shape import ModelShape
from rayspeed.model.attention import MaskRows, context_attention, masked_attention
from rayspeed.model.flex import flex_attention
from rayspeed.model.kv_cache import DecodeState
from rayspeed.model.parts.norms import ProjectionNorm, RMSNorm
from rayspeed.model.rope import apply_rope, rope_tables
from rayspeed.parallel.context_parallel import SequenceLayout, segment_positions
from rayspeed.parallel.groups import TensorParallel
from rayspeed.parallel.layers import ColumnParallelLinear, RowParallelLinear, enter_tp_region, sharded_parameter


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
        col = functools.partial(ColumnParallelLinear, tp=tp, shared_input=True, init_std=dims.init_std, seed=seed,
                                bias=dims.qkv_bias)
        self.wq = col(h, dims.num_heads * hd, name=f"{name}.wq")
        self.wk = col(h, dims.num_kv_heads * hd, name=f"{name}.wk")
        self.wv = col(h, dims.num_kv_heads * hd, name=f"{name}.wv")
        self.wo = RowParallelLinear(
            dims.num_heads * hd, h, tp, input_is_parallel=True, sequence_parallel=sequence_parallel,
            init_std=dims.residual_init_std, seed=seed, name=f"{name}.wo",
        )

    def normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [b, heads, s, head_dim] before RoPE: as they are here; a family's block may normalise them."""
        return q, k

    def forward(self, x: torch.Tensor, segment_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """segment_ids [b, s] (the full sequence, also under sequence parallelism): attention stays within a
        document and positions restart at each one. A DecodeState instead: the next tokens of a decoding pass."""
        if isinstance(segment_ids, DecodeState):
            return self.decode(x, segment_ids)
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
        out = self.core(q, k, v, MaskRows.of(s, segment_ids, self.window, x.device))
        out = out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        return self.wo(out)

    def decode(self, x: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """x [b, s, h]: the next s tokens of every row, attending over the keys and values cached so far and
        their own (causal); theirs are added to the cache."""
        x = enter_tp_region(x, self.tp, self.sequence_parallel)
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.normed(q, k)
        cos, sin = rope_tables(s, self.rotary_dim, self.rope_theta, device=x.device, dims=self.rope_dims,
                               positions=state.positions())
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = state.append(self, k, v)
        out = self.core(q, k, v, state.rows(self.window))
        return self.wo(out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Optional[MaskRows]) -> torch.Tensor:
        """The attention of q [b, heads, s, d] over k, v [b, kv_heads, s, d] under the mask rows describe (None:
        plain causal): SDPA, tiled masks, or FlexAttention. A family's attention replaces this (a sink logit)."""
        # (On CPU FlexAttention has a forward only: used there without autograd, as the parity tests compare it.)
        if self.flex and (q.is_cuda or not torch.is_grad_enabled()) and (rows is not None or self.cap):
            return flex_attention(q, k, v, rows, self.scale, self.cap)
        return masked_attention(q, k, v, rows, self.scale, self.cap)


class QKNormAttention(Attention):
    """Each query and key head RMS-normalised (a weight of head_dim, shared by every head and so whole on every
    tensor-parallel rank) before RoPE, in the family's norm class."""
    norm_class: type = RMSNorm

    def __init__(self, dims: ModelShape, tp: TensorParallel, sequence_parallel: bool, seed: int, name: str,
                 layer_idx: int = 0):
        super().__init__(dims, tp, sequence_parallel, seed, name, layer_idx)
        # Each tp rank normalises only its own heads, so its weight gradient is a partial sum: the weight goes
        # through the same identity-forward, all-reduce-backward path as a sequence-parallel norm's.
        self.q_norm = self.norm_class(dims.head_dim, dims.norm_eps, tp, sequence_parallel=True)
        self.k_norm = self.norm_class(dims.head_dim, dims.norm_eps, tp, sequence_parallel=True)

    def normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class ProjectionNormAttention(Attention):
    """q and k RMS-normalised over their whole projections (heads x head_dim wide) before RoPE (OLMo 2)."""

    def __init__(self, dims: ModelShape, tp: TensorParallel, sequence_parallel: bool, seed: int, name: str,
                 layer_idx: int = 0):
        super().__init__(dims, tp, sequence_parallel, seed, name, layer_idx)
        self.q_norm = ProjectionNorm(dims.q_dim, dims.norm_eps, tp)
        self.k_norm = ProjectionNorm(dims.kv_dim, dims.norm_eps, tp)

    def normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [b, heads, s, head_dim]: normalised over the projection (all heads of a position together)."""
        def over_projection(t: torch.Tensor, norm: ProjectionNorm) -> torch.Tensor:
            b, heads, s, d = t.shape
            flat = norm(t.transpose(1, 2).reshape(b, s, heads * d))
            return flat.view(b, s, heads, d).transpose(1, 2)

        return over_projection(q, self.q_norm), over_projection(k, self.k_norm)


class SinkAttention(Attention):
    """Each head's scores compete with a learned sink logit (gpt-oss's `sinks`): the softmax runs over the keys and
    the sink, and the sink's share is dropped, so a head may attend to nothing. The logits are split by tp with the
    heads. Math attention (the mask built whole): not under context parallelism."""

    def __init__(self, dims: ModelShape, tp: TensorParallel, sequence_parallel: bool, seed: int, name: str,
                 layer_idx: int = 0):
        super().__init__(dims, tp, sequence_parallel, seed, name, layer_idx)
        self.sinks = sharded_parameter((dims.num_heads,), 0, tp, std=dims.init_std, seed=seed, key=f"{name}.sinks")

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Optional[MaskRows]) -> torch.Tensor:
        s = q.shape[2]
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        mask = rows.rows(0, s) if rows is not None else torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        scale = self.scale if self.scale is not None else self.head_dim ** -0.5
        scores = (q @ k.transpose(-1, -2)).float() * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        sink = self.sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, s, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return probs.to(v.dtype) @ v
