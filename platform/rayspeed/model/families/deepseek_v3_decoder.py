"""DeepSeek-V3's decoder as transformers' DeepseekV3DecoderLayer computes it: multi-head latent attention, and on the
MoE layers a group-limited sigmoid router with its score correction beside always-on shared experts.

Latent attention under tensor parallelism: the down-projections (q's and the kv latent with the shared RoPE part)
and their norms are replicated; the up-projections are column-parallel by heads and o row-parallel, as the shared
attention's. Each tp rank's heads read the whole latents, so the latents' gradients are partial sums: they are
summed over tp where they leave the replicated part (copy_to_tp), which makes the down-projections' and norms'
gradients whole on every rank (as Qwen3's q/k norms'); the down-projections' input gradient is then whole on every
rank too, so it is divided by tp before the region's entry sums it (as the router's)."""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from rayspeed.config.shape import ModelShape
from rayspeed.families import deepseek_v3
from rayspeed.model.attention import MaskRows, masked_attention
from rayspeed.model.families import Composition
from rayspeed.model.moe import MoE
from rayspeed.model.parts.blocks import Block
from rayspeed.model.parts.norms import RMSNorm
from rayspeed.model.rope import apply_rope, rope_tables
from rayspeed.parallel.comm import copy_to_tp
from rayspeed.parallel.context_parallel import segment_positions
from rayspeed.parallel.expert_parallel import ScaleGrad
from rayspeed.parallel.groups import TensorParallel
from rayspeed.parallel.layers import NO_TP, ColumnParallelLinear, RowParallelLinear, enter_tp_region, sharded_parameter

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default: the latents' norms do not read rms_norm_eps


def _replicated(n_in: int, n_out: int, std: float, seed: int, key: str) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=False)
    layer.weight = sharded_parameter((n_out, n_in), None, NO_TP, std=std, seed=seed, key=f"{key}.weight")
    return layer


def interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over interleaved pairs (x0, x1), (x2, x3), ..., written out de-interleaved (the rotated evens, then the
    rotated odds), as transformers' apply_rotary_pos_emb_interleave; in fp32."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x32 = x.float()
    x1, x2 = x32[..., 0::2], x32[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).type_as(x)


class LatentAttention(nn.Module):
    def __init__(self, dims: ModelShape, tp: TensorParallel, sequence_parallel: bool, seed: int, name: str,
                 layer_idx: int = 0):
        super().__init__()
        self.tp, self.sequence_parallel = tp, sequence_parallel
        key = dims.family_key
        h, std = dims.hidden_size, dims.init_std
        self.q_rank, self.kv_rank = key("q_lora_rank"), int(key("kv_lora_rank"))
        self.nope, self.rope_dim, self.v_dim = int(key("qk_nope_head_dim")), int(key("qk_rope_head_dim")), int(
            key("v_head_dim"))
        self.interleave = bool(key("rope_interleave"))
        self.local_heads = dims.num_heads // tp.world_size
        qk = self.nope + self.rope_dim
        col = functools.partial(ColumnParallelLinear, tp=tp, shared_input=True, init_std=std, seed=seed)
        if self.q_rank:
            self.wq_a = _replicated(h, int(self.q_rank), std, seed, f"{name}.wq_a")
            self.q_a_norm = RMSNorm(int(self.q_rank), LATENT_NORM_EPS)
            self.wq_b = col(int(self.q_rank), dims.num_heads * qk, name=f"{name}.wq_b")
        else:
            self.wq = col(h, dims.num_heads * qk, name=f"{name}.wq")
        self.wkv_a = _replicated(h, self.kv_rank + self.rope_dim, std, seed, f"{name}.wkv_a")
        self.kv_a_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.wkv_b = col(self.kv_rank, dims.num_heads * (self.nope + self.v_dim), name=f"{name}.wkv_b")
        self.wo = RowParallelLinear(dims.num_heads * self.v_dim, h, tp, input_is_parallel=True,
                                    sequence_parallel=sequence_parallel, init_std=dims.residual_init_std, seed=seed,
                                    name=f"{name}.wo")
        self.rope_theta, scaled = dims.rope_of(layer_idx)
        self.rope_dims: Optional[ModelShape] = dims if scaled else None
        self.scale = qk ** -0.5 * _yarn_mscale(dims) ** 2

    def _whole(self, latent: torch.Tensor) -> torch.Tensor:
        return copy_to_tp(latent, self.tp) if self.tp.enabled else latent

    def forward(self, x: torch.Tensor, segment_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = enter_tp_region(x, self.tp, self.sequence_parallel)
        b, s, _ = x.shape
        down = ScaleGrad.apply(x, 1.0 / self.tp.world_size) if self.tp.enabled else x
        if self.q_rank:
            q = self.wq_b(self._whole(self.q_a_norm(self.wq_a(down))))
        else:
            q = self.wq(x)
        q = q.view(b, s, self.local_heads, self.nope + self.rope_dim).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rot = self.wkv_a(down).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self._whole(self.kv_a_norm(latent)))
        kv = kv.view(b, s, self.local_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rot = self._whole(k_rot).view(b, 1, s, self.rope_dim)
        positions = None if segment_ids is None else segment_positions(segment_ids)
        cos, sin = rope_tables(s, self.rope_dim, self.rope_theta, device=x.device, dims=self.rope_dims,
                               positions=positions)
        rotate = interleaved_rope if self.interleave else apply_rope
        q_rot, k_rot = rotate(q_rot, cos, sin), rotate(k_rot, cos, sin)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, self.local_heads, -1, -1)], dim=-1)
        out = masked_attention(q, k, v.contiguous(), MaskRows.of(s, segment_ids, None, x.device), self.scale)
        return self.wo(out.transpose(1, 2).reshape(b, s, self.local_heads * self.v_dim))


def _yarn_mscale(dims: ModelShape) -> float:
    """The yarn softmax-scale factor of transformers' DeepSeek attention (mscale_all_dim's; 1 without yarn)."""
    if dims.rope_type == "default" or not dims.rope_mscale_all_dim or dims.rope_factor <= 1:
        return 1.0
    return 0.1 * dims.rope_mscale_all_dim * math.log(dims.rope_factor) + 1.0


class SharedExperts(nn.Module):
    """The always-on SwiGLU beside the routed experts, split over tp as the dense MLP (its output a partial sum
    inside the MoE's tp region)."""

    def __init__(self, dims: ModelShape, width: int, tp: TensorParallel, seed: int, name: str):
        super().__init__()
        h = dims.hidden_size
        self.w_gate, self.w_up = nn.Linear(h, width, bias=False), nn.Linear(h, width, bias=False)
        self.w_down = nn.Linear(width, h, bias=False)
        split = tp if tp.enabled else NO_TP
        for part, dim, std in (("w_gate", 0, dims.init_std), ("w_up", 0, dims.init_std),
                               ("w_down", 1, dims.residual_init_std)):
            full = (width, h) if dim == 0 else (h, width)
            getattr(self, part).weight = sharded_parameter(full, dim if tp.enabled else None, split, std=std,
                                                           seed=seed, key=f"{name}.{part}.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class DeepseekMoE(MoE):
    """Group-limited sigmoid routing with the score correction (a frozen parameter, loaded, saved and exported,
    which model.router_bias_update moves by load after each step: balance_bias), and the shared experts beside."""

    def __init__(self, dims: ModelShape, seed: int, name: str, stats: Any = None, tp: Optional[TensorParallel] = None,
                 sequence_parallel: bool = False):
        super().__init__(dims, seed, name, stats, tp, sequence_parallel)
        key = dims.family_key
        self.groups, self.top_groups = int(key("n_group")), int(key("topk_group"))
        self.scaling, self.normalise = float(key("routed_scaling_factor")), dims.norm_topk_prob
        self.router.score_bias = nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)
        self.step_load: Optional[torch.Tensor] = None  # tokens per expert of the training forwards since a balance
        self.shared = SharedExperts(dims, deepseek_v3.shared_experts_width(dims), self.tp, seed, f"{name}.shared")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.router.weight.float()).sigmoid()
        choice = scores + cast(torch.Tensor, self.router.score_bias).float()
        per_group = self.num_experts // self.groups
        group_scores = choice.view(-1, self.groups, per_group).topk(2, dim=-1).values.sum(-1)
        best = group_scores.topk(self.top_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores).scatter_(1, best, 1.0).bool().repeat_interleave(per_group, dim=1)
        experts = choice.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        if self.normalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.stats is not None:  # the load metrics (transformers adds no balance loss for this family)
            counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts).float()
            self.stats.add(counts, (scores / scores.sum(-1, keepdim=True)).sum(0), x.shape[0])
            if self.stats.recording and self.stats.windowed:  # a training forward (not a recomputation)
                self.step_load = counts if self.step_load is None else self.step_load + counts
        return (weights * self.scaling).to(x.dtype), experts

    def beside(self, flat: torch.Tensor) -> Optional[torch.Tensor]:
        return self.shared(flat)

    def balance_bias(self, speed: float, group: Any) -> None:
        """DeepSeek-V3's auxiliary-loss-free update: the score correction moves by `speed` toward an even load,
        up for an expert that took fewer tokens than the mean since the last call, down for one that took more;
        the load summed over `group` (every data-parallel rank's tokens), so every rank moves it alike."""
        load, self.step_load = self.step_load, None
        if load is None:
            return
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(load, group=group)
        with torch.no_grad():
            bias = cast(torch.Tensor, self.router.score_bias)
            bias.add_(speed * torch.sign(load.mean() - load).to(bias.dtype))


class DeepseekBlock(Block):
    attention_class = LatentAttention
    moe_class = DeepseekMoE


MODEL = Composition(families=(deepseek_v3.FAMILY,), block=DeepseekBlock)
