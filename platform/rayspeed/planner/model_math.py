"""Parameter counts and FLOPs of the platform's decoder (RMSNorm, RoPE, SwiGLU MLP, grouped-query attention,
no biases), globally and per rank under tensor and pipeline parallelism."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    h: int  # hidden size
    L: int  # layers
    a: int  # query heads
    kv: int  # key/value heads
    f: int  # SwiGLU inner width
    v: int  # vocabulary
    s: int  # sequence length
    tied: bool  # input embedding shared with the output head

    @classmethod
    def from_config(cls, m) -> "Shape":
        return cls(h=m.hidden_size, L=m.num_layers, a=m.num_heads, kv=m.kv_heads, f=m.ffn_size,
                   v=m.vocab_size, s=m.seq_len, tied=m.tie_embeddings)

    @property
    def head_dim(self) -> int:
        return self.h // self.a

    @property
    def kv_dim(self) -> int:
        return self.kv * self.head_dim

    # ---- parameters

    @property
    def layer_matrix_params(self) -> int:
        """q and o (h x h), k and v (h x kv_dim each), gate/up/down (h x f each): all split by tp."""
        return 2 * self.h * self.h + 2 * self.h * self.kv_dim + 3 * self.h * self.f

    @property
    def layer_norm_params(self) -> int:
        """Two RMSNorm weights, replicated on every tp rank."""
        return 2 * self.h

    @property
    def layer_params(self) -> int:
        return self.layer_matrix_params + self.layer_norm_params

    @property
    def embedding_params(self) -> int:
        return self.v * self.h

    @property
    def head_params(self) -> int:
        return 0 if self.tied else self.v * self.h

    @property
    def params(self) -> int:
        """Total parameters N (final norm included)."""
        return self.L * self.layer_params + self.embedding_params + self.head_params + self.h

    # ---- FLOPs

    @property
    def flops_per_token(self) -> float:
        """Model FLOPs per token, forward + backward: 6N + 12 L h s (the MFU convention: recomputation
        is hardware work, not model work)."""
        return 6.0 * self.params + 12.0 * self.L * self.h * self.s


def stage_params(sh: Shape, tp: int, pp: int, stage: int) -> int:
    """Parameters held by one rank of pipeline stage `stage` (0-based) with tensor degree tp.
    Layers are split evenly (pp divides L); the vocab-parallel embedding sits on the first stage, the final
    norm and output head on the last; a tied head on pp > 1 is a second copy on the last stage (its
    gradient is all-reduced with the first stage's)."""
    layers = sh.L // pp
    n = layers * (sh.layer_matrix_params // tp + sh.layer_norm_params)
    if stage == 0:
        n += sh.embedding_params // tp
    if stage == pp - 1:
        n += sh.h
        if not sh.tied or pp > 1:
            n += sh.v * sh.h // tp
    return n


def max_stage_params(sh: Shape, tp: int, pp: int) -> int:
    return max(stage_params(sh, tp, pp, 0), stage_params(sh, tp, pp, pp - 1))
