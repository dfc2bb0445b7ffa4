"""The model's shape with every optional field resolved: the one type the planner, the model builder, the
checkpoint and the exporter read. Torch-free.

Parameter counts and FLOPs follow the platform's decoder (RMSNorm, RoPE, SwiGLU MLP, grouped-query attention,
no biases).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def default_ffn(hidden_size: int) -> int:
    """SwiGLU inner width when none is given: 8/3 h rounded up to a multiple of 64."""
    return -(-(8 * hidden_size // 3) // 64) * 64


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    """Width of the residual stream (h)."""
    num_layers: int
    """Transformer blocks (L)."""
    num_heads: int
    """Query heads (a)."""
    num_kv_heads: int
    """Key/value heads (kv)."""
    ffn_hidden_size: int
    """SwiGLU inner width (f)."""
    vocab_size: int
    """Vocabulary (v)."""
    seq_len: int
    """Training sequence length (s)."""
    tie_embeddings: bool
    """Input embedding shared with the output head."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""

    @classmethod
    def from_config(cls, m: Any) -> "ModelShape":
        """From a `model` config section (or anything with its field names)."""
        if isinstance(m, cls):
            return m
        heads = int(m.num_heads)
        kv = getattr(m, "num_kv_heads", None)
        ffn = getattr(m, "ffn_hidden_size", None)
        return cls(hidden_size=int(m.hidden_size), num_layers=int(m.num_layers), num_heads=heads,
                   num_kv_heads=int(kv) if kv is not None else heads,
                   ffn_hidden_size=int(ffn) if ffn is not None else default_ffn(int(m.hidden_size)),
                   vocab_size=int(m.vocab_size), seq_len=int(m.seq_len), tie_embeddings=bool(m.tie_embeddings),
                   rope_theta=float(getattr(m, "rope_theta", 10000.0)), norm_eps=float(getattr(m, "norm_eps", 1e-5)),
                   init_std=float(getattr(m, "init_std", 0.02)))

    # ---- derived sizes

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def residual_init_std(self) -> float:
        # GPT-2 / Megatron: shrink the layers that write into the residual stream so its variance does not grow
        # with depth.
        return self.init_std / math.sqrt(2 * self.num_layers)

    # ---- parameters

    @property
    def layer_matrix_params(self) -> int:
        """q and o (h x h), k and v (h x kv_dim each), gate/up/down (h x f each): all split by tp."""
        h = self.hidden_size
        return 2 * h * h + 2 * h * self.kv_dim + 3 * h * self.ffn_hidden_size

    @property
    def layer_norm_params(self) -> int:
        """Two RMSNorm weights, replicated on every tp rank."""
        return 2 * self.hidden_size

    @property
    def layer_params(self) -> int:
        return self.layer_matrix_params + self.layer_norm_params

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        return 0 if self.tie_embeddings else self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        """Total parameters N (final norm included)."""
        return self.num_layers * self.layer_params + self.embedding_params + self.head_params + self.hidden_size

    # ---- FLOPs

    @property
    def flops_per_token(self) -> float:
        """Model FLOPs per token, forward + backward: 6N + 12 L h s (the MFU convention: recomputation is
        hardware work, not model work)."""
        return 6.0 * self.params + 12.0 * self.num_layers * self.hidden_size * self.seq_len
