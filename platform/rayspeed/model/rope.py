"""Rotary position embeddings as transformers computes them: the inverse frequencies with the shape's scaling,
the cos/sin tables (positions that restart per document too) and the rotate-half rotation, all in fp32."""

from __future__ import annotations

import math
from typing import Optional

import torch

from rayspeed.config.shape import ModelShape


def rope_inv_freq(head_dim: int, theta: float, dims: Optional[ModelShape] = None, device=None,
                  seq_len: int = 0) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2] in fp32, with the shape's linear, llama3, yarn or longrope scaling
    (computed as transformers does, so a pretrained model sees the positions it was trained with). seq_len: the
    longest position + 1 of the batch, which picks longrope's long factors beyond the original context."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / theta ** exponents
    if dims is None:  # no shape: no scaling
        return inv_freq
    kind = dims.rope_type
    if kind == "yarn":
        return yarn_inv_freq(head_dim, theta, dims, device)
    if kind == "longrope":
        factors = dims.rope_long_factor if seq_len > dims.rope_original_max_positions else dims.rope_short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device=device) * theta ** exponents)
    if kind == "linear":
        return inv_freq / dims.rope_factor
    if kind == "llama3":
        factor, low, high = dims.rope_factor, dims.rope_low_freq_factor, dims.rope_high_freq_factor
        old_len = dims.rope_original_max_positions
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind != "default":
        raise ValueError(f"unsupported rope type {kind!r}")
    return inv_freq


def yarn_inv_freq(head_dim: int, theta: float, dims: ModelShape, device=None) -> torch.Tensor:
    """YaRN (Peng et al. 2023): interpolated frequencies below the slow boundary, the original ones above the fast
    one, a linear ramp between (transformers' _compute_yarn_parameters)."""
    factor, original = dims.rope_factor, dims.rope_original_max_positions

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(dims.rope_beta_fast), correction_dim(dims.rope_beta_slow)
    if dims.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_factor(dims: Optional[ModelShape]) -> float:
    """What yarn and longrope multiply cos and sin by (1 for the other types): the file's attention_factor, else
    the papers' default from the factor."""
    if dims is None or dims.rope_type not in ("yarn", "longrope"):
        return 1.0
    if dims.rope_attention_factor:
        return dims.rope_attention_factor
    factor = dims.rope_factor
    if dims.rope_type == "longrope":
        original = dims.rope_original_max_positions
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if dims.rope_mscale and dims.rope_mscale_all_dim:
        return mscale(factor, dims.rope_mscale) / mscale(factor, dims.rope_mscale_all_dim)
    return mscale(factor)


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None,
                dims: Optional[ModelShape] = None,
                positions: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [seq_len, head_dim] in fp32 for rotate-half RoPE (built per call: cheap, no state to keep in sync);
    with positions [b, s]: [b, 1, s, head_dim], each row at its own positions."""
    longest = seq_len
    if positions is not None and dims is not None and dims.rope_type == "longrope":
        longest = int(positions.max()) + 1  # transformers: max(position_ids) + 1 picks the factors
    inv_freq = rope_inv_freq(head_dim, theta, dims, device, seq_len=longest)
    scale = attention_factor(dims)
    if positions is not None:
        angles = positions.to(torch.float32)[..., None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)[:, None]
    else:
        angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [batch, heads, seq, head_dim] by position; in fp32, back to x's dtype. Tables narrower than the head
    (partial rotary) rotate its first dimensions and pass the rest through."""
    x32 = x.float()
    rot, rest = x32[..., :cos.shape[-1]], x32[..., cos.shape[-1]:]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    out = rot * cos + rotated * sin
    return (torch.cat([out, rest], dim=-1) if rest.shape[-1] else out).type_as(x)
