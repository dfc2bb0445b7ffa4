"""The `model.adapter` section of the job file (its rules and sizes are config/adapter.py's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class AdapterConfig:
    type: Literal["none", "lora"] = "none"
    """none: every parameter trains; lora: the base weights are frozen and low-rank adapters A (rank x in) and
    B (out x rank, zeros at start) train beside the targeted linear layers, y = W x + scale * B A x."""
    rank: int = 16
    """LoRA rank r: A is r x in, B is out x r (8 to 64 is usual; the adapter's size and time grow with it)."""
    alpha: float = 32.0
    """LoRA alpha: scale = alpha / rank (alpha / sqrt(rank) with rslora)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (the base path sees the input unchanged)."""
    targets: list[str] = field(default_factory=lambda: ["all"])
    """Roles whose linear layers get an adapter: q, k, v, o, gate, up, down, or all (every linear layer of every
    block, as Axolotl's all-linear)."""
    rank_pattern: dict[str, int] = field(default_factory=dict)
    """Per-role ranks over `rank`, e.g. {q: 32, v: 32} (peft's rank_pattern, written with the projections' names)."""
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    """Per-role alphas over `alpha` (peft's alpha_pattern); each role's scale is its alpha over its rank."""
    trainable: list[str] = field(default_factory=list)
    """Parameters that train in full beside the adapters: embed (the input embedding), head (the output head;
    with tied embeddings the one shared matrix), norms."""
    rslora: bool = False
    """rsLoRA: scale = alpha / sqrt(rank), stable at large ranks."""
    dora: bool = False
    """DoRA: a trained magnitude per output feature times the row-normalised W + scale * B A (needs the whole base
    weight each forward: ZeRO 0-2)."""
    base_precision: Literal["auto", "nf4"] = "auto"
    """auto: the base weights in the job's precision; nf4: the base's linear layers quantized at load to 4-bit
    NormalFloat in blocks of 64 (QLoRA, through bitsandbytes; embeddings, norms and the head stay in the job's
    precision). Needs bitsandbytes and ZeRO 0-2."""
    lora_plus_ratio: float = 0.0
    """LoRA+: the learning rate of every B is this many times train.lr (the LoRA+ paper suggests 16; its schedule
    follows train.lr's); 0: one learning rate for all."""
    double_quant: bool = True
    """With nf4: store each block's scale in 8 bits too (QLoRA's double quantization, about 0.37 bit per weight
    saved; under tensor parallelism the scales of each rank's blocks stay in fp32, exactly the whole matrix's)."""
    compute_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """With nf4: the dtype the 4-bit weights are dequantized to for each product (bnb_4bit_compute_dtype); auto is
    the job's precision."""
