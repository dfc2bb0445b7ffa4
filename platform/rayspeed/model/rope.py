"""Rotary position embeddings as transformers computes them: the inverse frequencies with the shape's scaling,
the cos/sin tables (positions that restart per document too) and the rotate-half rotation, all in fp32."""

from __future__ import annotations

import math
from typing import Optional

import torch

from rayspeed.config.shape import ModelShape


def rope_inv_freq(head_dim: int, theta: float, dims: Optional[ModelShape] = None, device=None) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2] in fp32, with the shape's linear or llama3 scaling (computed as
    transformers does, so a pretrained model sees the positions it was trained with)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    kind = dims.rope_type if dims is not None else "default"
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


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None,
                dims: Optional[ModelShape] = None,
                positions: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [seq_len, head_dim] in fp32 for rotate-half RoPE (built per call: cheap, no state to keep in sync);
    with positions [b, s]: [b, 1, s, head_dim], each row at its own positions."""
    inv_freq = rope_inv_freq(head_dim, theta, dims, device)
    if positions is not None:
        angles = positions.to(torch.float32)[..., None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)[:, None]
        return angles.cos(), angles.sin()
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [batch, heads, seq, head_dim] by position; in fp32, back to x's dtype."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x32 * cos + rotated * sin).type_as(x)
