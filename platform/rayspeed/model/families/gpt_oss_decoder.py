"""gpt-oss's decoder as transformers' GptOssDecoderLayer computes it: the sink attention with a bias on its output
projection, and a mixture of experts whose router has a bias and whose experts are SwiGLUs with biases, the gate
clamped above and the linear part on both sides at swiglu_limit: gate * sigmoid(alpha * gate) * (up + 1). Its
windows and yarn RoPE are the shape's, which the shared parts read. Also the reader and writer of its checkpoints'
expert tensors (gate and up interleaved in one tensor, [experts, in, out]; MXFP4 blocks and scales)."""

from __future__ import annotations

from typing import Any, Mapping, Optional, cast

import torch
import torch.nn.functional as F

from rayspeed.config.shape import ModelShape
from rayspeed.families import gpt_oss
from rayspeed.model.families import Composition
from rayspeed.model.moe import MoE
from rayspeed.model.parts.blocks import Block
from rayspeed.model.parts.self_attention import SinkAttention
from rayspeed.parallel.comm import copy_to_tp
from rayspeed.parallel.expert_parallel import ScaleGrad
from rayspeed.parallel.groups import TensorParallel
from rayspeed.parallel.layers import NO_TP, sharded_parameter

# MXFP4's sixteen values (E2M1), by their 4-bit code.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class GptOssAttention(SinkAttention):
    """The sink attention, and a bias after the output projection (replicated; under sequence parallelism each
    rank adds it to its shard, so its gradient is summed over tp as a norm weight's)."""

    def __init__(self, dims: ModelShape, tp: TensorParallel, sequence_parallel: bool, seed: int, name: str,
                 layer_idx: int = 0):
        super().__init__(dims, tp, sequence_parallel, seed, name, layer_idx)
        self.wo.bias = sharded_parameter((dims.hidden_size,), None, NO_TP, std=0.0, seed=seed, key=f"{name}.wo.bias")
        if self.sequence_parallel:
            self.wo.bias.sequence_parallel = True  # type: ignore[attr-defined]  # a tag torch's stubs lack

    def forward(self, x: torch.Tensor, segment_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        bias = cast(torch.Tensor, self.wo.bias)
        bias = copy_to_tp(bias, self.tp) if self.sequence_parallel else bias
        return super().forward(x, segment_ids) + bias


class GptOssMoE(MoE):
    """The router with a bias; each expert's gate, up and down with biases, the clamped SwiGLU between."""

    expert_params = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")

    def __init__(self, dims: ModelShape, seed: int, name: str, stats: Any = None, tp: Optional[TensorParallel] = None,
                 sequence_parallel: bool = False):
        super().__init__(dims, seed, name, stats, tp, sequence_parallel)
        e, h, f = dims.num_experts, dims.hidden_size, dims.expert_ffn_hidden_size
        self.alpha, self.limit = float(dims.family_key("swiglu_alpha")), float(dims.family_key("swiglu_limit"))
        self.router.bias = sharded_parameter((e,), None, NO_TP, std=dims.init_std, seed=seed, key=f"{name}.router.bias")
        split = self.tp if self.tp.enabled else NO_TP
        along = 1 if self.tp.enabled else None
        self.b_gate = sharded_parameter((e, f), along, split, std=0.0, seed=seed, key=f"{name}.b_gate")
        self.b_up = sharded_parameter((e, f), along, split, std=0.0, seed=seed, key=f"{name}.b_up")
        self.b_down = sharded_parameter((e, h), None, NO_TP, std=0.0, seed=seed, key=f"{name}.b_down")

    def grouped(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        w_gate, w_up, w_down, b_gate, b_up, b_down = (getattr(self, n) for n in self.expert_params)
        if self.ep.enabled:  # the mean over dp, as the shared experts' (MoE.grouped)
            w_gate, w_up, w_down, b_gate, b_up, b_down = (ScaleGrad.apply(w, 1.0 / self.ep.world_size)
                                                          for w in (w_gate, w_up, w_down, b_gate, b_up, b_down))
        if self.tp.enabled:  # every tp rank's partial output would add it: each adds its share, summed back
            b_down = copy_to_tp(b_down, self.tp) / self.tp.world_size
        counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())
        expert = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts)
        gate = F.grouped_mm(rows, w_gate.transpose(1, 2), offs=offsets) + b_gate[expert]
        up = F.grouped_mm(rows, w_up.transpose(1, 2), offs=offsets) + b_up[expert]
        gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        inner = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return F.grouped_mm(inner.contiguous(), w_down.transpose(1, 2), offs=offsets) + b_down[expert]


class GptOssBlock(Block):
    attention_class = GptOssAttention
    moe_class = GptOssMoE


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., rows, groups, 16] bytes and [..., rows, groups] biased exponents -> [..., rows, groups * 32] fp32: each
    byte two values (low nibble first), times 2 ** (scale - 127)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    values = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1).flatten(-2)
    out = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return out.flatten(-2)


class GptOssWeights:
    """The expert stacks from either stored form (gpt_oss.forms), and back to the unpacked one."""

    def read(self, name: str, form: Mapping[str, Any], fetch: Any, experts: range, shape: ModelShape) -> torch.Tensor:
        """`fetch(name)`: a checkpoint tensor's slice; `fetch.shared(key, make)`: make() kept for the next read."""
        layer, _, suffix = name.removeprefix("layers.").partition(".")
        hf, _ = gpt_oss.STACKS[suffix]
        base = f"model.layers.{layer}.{gpt_oss.EXPERTS}{hf}"
        rows = slice(experts.start, experts.stop)
        if hf.endswith("_bias"):
            value = fetch(base)[rows].float()  # [experts, 2f] (gate even, up odd) or [experts, h]
            return value[:, _half(suffix)] if hf.startswith("gate_up") else value
        def dense() -> torch.Tensor:  # [experts, out, in]
            if base in form:  # unpacked, [experts, in, out]
                return fetch(base)[rows].float().transpose(1, 2)
            # MXFP4, [experts, out, in / 32, 16] and [experts, out, in / 32]
            return dequantize_mxfp4(fetch(base + "_blocks")[rows], fetch(base + "_scales")[rows])

        if not hf.startswith("gate_up"):
            return dense()
        return fetch.shared((base, rows.start, rows.stop), dense)[:, _half(suffix)]  # gate, then up: read once

    def write(self, state: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
        out = {}
        for i in range(shape.num_layers):
            if not shape.is_moe(i):
                continue
            p, base = f"layers.{i}.mlp.", f"model.layers.{i}.{gpt_oss.EXPERTS}"
            gate_up = torch.stack([state[p + "w_gate"], state[p + "w_up"]], dim=2).flatten(1, 2)  # rows interleaved
            out[base + "gate_up_proj"] = gate_up.transpose(1, 2).contiguous()
            out[base + "gate_up_proj_bias"] = torch.stack([state[p + "b_gate"], state[p + "b_up"]], dim=2).flatten(1)
            out[base + "down_proj"] = state[p + "w_down"].transpose(1, 2).contiguous()
            out[base + "down_proj_bias"] = state[p + "b_down"].contiguous()
        return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def _half(suffix: str) -> slice:
    """gate_up's rows of the gate (even) or of up (odd)."""
    return slice(0, None, 2) if suffix.endswith("gate") else slice(1, None, 2)


MODEL = Composition(families=(gpt_oss.FAMILY,), block=GptOssBlock, weights=GptOssWeights())
