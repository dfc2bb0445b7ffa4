"""The model's shape with every optional field resolved: the one type the planner, the model builder, the
checkpoint and the exporter read. Torch-free.

Parameter counts and FLOPs follow the platform's decoder (RMSNorm, RoPE, SwiGLU MLP, grouped-query attention,
no biases except the optional q/k/v biases of Qwen2-style models). What differs between model families (q/k/v
biases, the head width) comes from the family's record in rayspeed.families.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Optional

from rayspeed import families
from rayspeed.config.vision_shape import VisionShape
from rayspeed.families import Family
from rayspeed.families.family import QK_NORM_PER_HEAD, QK_NORM_PER_PROJECTION


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
    architecture: str = families.DEFAULT.architecture
    """Hugging Face architecture this model is (what an export's config.json names)."""
    qkv_bias: bool = False
    """q, k and v projections carry biases (derived from the architecture's family)."""
    rope_type: str = "default"
    """RoPE frequency scaling: default (none), linear or llama3."""
    rope_factor: float = 1.0
    """linear / llama3: the frequency division factor."""
    rope_low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_positions / this are divided by rope_factor."""
    rope_high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_positions / this are kept."""
    rope_original_max_positions: int = 0
    """llama3, yarn, longrope: the context length the model was pretrained with."""
    rope_attention_factor: float = 0.0
    """yarn, longrope: what cos and sin are multiplied by; 0: the default derived from the factor."""
    rope_beta_fast: float = 32.0
    """yarn: rotations above which the frequencies are kept (extrapolation)."""
    rope_beta_slow: float = 1.0
    """yarn: rotations below which they are divided by the factor (interpolation)."""
    rope_mscale: float = 0.0
    """yarn: mscale of the attention factor (DeepSeek's form; 0: unused)."""
    rope_mscale_all_dim: float = 0.0
    """yarn: mscale_all_dim of the attention factor (0: unused)."""
    rope_truncate: bool = True
    """yarn: round the correction range to whole dimensions."""
    rope_long_factor: tuple[float, ...] = ()
    """longrope: per-frequency divisors beyond rope_original_max_positions."""
    rope_short_factor: tuple[float, ...] = ()
    """longrope: per-frequency divisors within it."""
    max_position_embeddings: Optional[int] = None
    """Longest sequence the model supports (config.json's max_position_embeddings); None: no stated limit."""
    head_dim: int = 0
    """Width of one attention head (the family's rule; 0 when built directly: hidden_size / num_heads)."""
    hidden_act: str = "silu"
    """The MLP's gate activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU, Gemma)."""
    attention_kernel: str = "auto"
    """model.attention_kernel: auto | sdpa | flex (masked and soft-capped attention's kernel on CUDA)."""
    sliding_window: Optional[int] = None
    """Keys a query of a sliding-window layer sees: itself and the window - 1 before it. None: no window."""
    layer_types: tuple[str, ...] = ()
    """Each layer's attention, config.json's names (full_attention, sliding_attention); empty: every layer slides
    when sliding_window is set."""
    rope_local_theta: Optional[float] = None
    """RoPE base of the sliding-window layers (Gemma 3's local layers; plain RoPE); None: rope_theta and its
    scaling, as every other layer."""
    query_pre_attn_scalar: Optional[float] = None
    """Attention scale query_pre_attn_scalar^-0.5 (Gemma); None: head_dim^-0.5."""
    attn_logit_softcapping: Optional[float] = None
    """Attention scores soft-capped to (-c, c) by c tanh(x / c) before the softmax (Gemma 2: 50); None: none."""
    final_logit_softcapping: Optional[float] = None
    """Output logits soft-capped the same way before the loss (Gemma 2: 30); None: none."""
    partial_rotary_factor: float = 1.0
    """The share of each head RoPE rotates (its first dimensions; Phi-4-mini: 0.75); the rest passes through."""
    num_experts: int = 0
    """Routed experts of each MoE layer; 0: a dense model."""
    experts_per_token: int = 0
    """Experts each token goes to (top-k)."""
    expert_ffn_hidden_size: int = 0
    """One expert's SwiGLU inner width."""
    norm_topk_prob: bool = True
    """The top-k routing weights are renormalised to sum to 1."""
    moe_layers: tuple[int, ...] = ()
    """The layers whose MLP is a mixture of experts (resolved: every layer of a model with experts unless given)."""
    router_aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss in the training loss (a training setting, not part of the function)."""
    family_keys: tuple[tuple[str, Any], ...] = ()
    """The family's own config.json keys (Family.keys.own) that differ from its defaults, sorted: family_key()."""
    image_path: Optional[VisionShape] = None
    """The image path before the text model (a vision-language checkpoint's tower and projector); None: text only."""

    def family_key(self, key: str) -> Any:
        """The value of one of the family's own config.json keys: the model's, else the family's default."""
        own = self.family.keys.own
        if key not in own:
            raise KeyError(f"{key!r} is not a config.json key of {self.architecture} (its own: {sorted(own)})")
        return dict(self.family_keys).get(key, own[key])

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.family.head_dim(self.hidden_size, self.num_heads))

    @classmethod
    def from_config(cls, m: Any) -> "ModelShape":
        """From a `model` config section (or anything with its field names)."""
        return m if isinstance(m, cls) else cls(**shape_fields(m))

    @property
    def family(self) -> Family:
        """The model family of the architecture (the default family's for a name rayspeed does not run)."""
        return families.find(self.architecture) or families.DEFAULT

    @property
    def rope_scaling(self) -> Optional[dict[str, Any]]:
        """The scaling in config.json's form (None for plain RoPE)."""
        if self.rope_type == "default":
            return None
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.rope_factor}
        if self.rope_type == "llama3":
            out.update(low_freq_factor=self.rope_low_freq_factor, high_freq_factor=self.rope_high_freq_factor,
                       original_max_position_embeddings=self.rope_original_max_positions)
        if self.rope_type in ("yarn", "longrope"):
            out["original_max_position_embeddings"] = self.rope_original_max_positions
            if self.rope_attention_factor:
                out["attention_factor"] = self.rope_attention_factor
        if self.rope_type == "yarn":
            out.update(beta_fast=self.rope_beta_fast, beta_slow=self.rope_beta_slow, truncate=self.rope_truncate)
            out.update({k: v for k, v in (("mscale", self.rope_mscale), ("mscale_all_dim", self.rope_mscale_all_dim))
                        if v})
        if self.rope_type == "longrope":
            out.update(long_factor=list(self.rope_long_factor), short_factor=list(self.rope_short_factor))
        return out

    # ---- attention per layer

    def window_of(self, layer: int) -> Optional[int]:
        """The sliding window of layer `layer` (None: it attends to every earlier position)."""
        if not self.sliding_window:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def rope_of(self, layer: int) -> tuple[float, bool]:
        """(RoPE base, whether rope_scaling applies) of layer `layer`."""
        if self.rope_local_theta and self.window_of(layer):
            return self.rope_local_theta, False
        return self.rope_theta, True

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (transformers: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> Optional[float]:
        """The softmax scale when it is not head_dim^-0.5 (None: the default)."""
        return self.query_pre_attn_scalar ** -0.5 if self.query_pre_attn_scalar else None

    def attention_span(self, layer: int) -> int:
        """Keys per query the FLOP count charges layer `layer`: the sequence, or its window when shorter."""
        window = self.window_of(layer)
        return min(window, self.seq_len) if window else self.seq_len

    @functools.cached_property  # read for every layout and stage a search costs
    def windowed_layers(self) -> int:
        """Layers whose sliding window is shorter than the sequence (they attend through a mask)."""
        return sum(1 for i in range(self.num_layers) if self.attention_span(i) < self.seq_len)

    # ---- derived sizes

    @property
    def q_dim(self) -> int:
        """Width of q and of the output projection's input: heads * head_dim (hidden only where they agree)."""
        return self.family.query_width(self.num_heads, self.head_dim)

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def residual_init_std(self) -> float:
        # GPT-2 / Megatron: shrink the layers that write into the residual stream so its variance does not grow
        # with depth.
        return self.init_std / math.sqrt(2 * self.num_layers)

    # ---- parameters

    def is_moe(self, layer: int) -> bool:
        """Layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer in self.moe_layers

    @property
    def expert_params(self) -> int:
        """One expert's gate, up and down matrices."""
        return 3 * self.hidden_size * self.expert_ffn_hidden_size

    def mlp_params_of(self, layer: int) -> int:
        """Layer `layer`'s MLP: gate/up/down (h x f each), or every expert's and the router's (experts x h)."""
        if self.is_moe(layer):
            return self.num_experts * (self.expert_params + self.hidden_size)
        return 3 * self.hidden_size * self.ffn_hidden_size

    @functools.cached_property
    def attention_matrix_params(self) -> int:
        """q and o (h x q_dim), k and v (h x kv_dim each), and the q/k/v biases when present: split by tp; a
        family's own attention (Family.attention.params): all of its parameters."""
        if self.family.attention.params is not None:
            return sum(math.prod(dims) for dims in self.family.attention.params(self).values())
        h, q = self.hidden_size, self.q_dim
        bias = (q + 2 * self.kv_dim) if self.qkv_bias else 0
        # q/k norms over the whole projections (OLMo 2) are split by tp with the heads.
        norms = (q + self.kv_dim) if self.family.tensor_names.qk_norm == QK_NORM_PER_PROJECTION else 0
        return 2 * h * q + 2 * h * self.kv_dim + bias + norms

    @functools.cached_property
    def mlp_params(self) -> int:
        """Every layer's MLP parameters together (all experts counted)."""
        return sum(self.mlp_params_of(i) for i in range(self.num_layers))

    @functools.cached_property  # read for every stage of every layout a search costs
    def layer_matrix_params(self) -> int:
        """The attention's matrices and the MLP's (per layer; a mean over the layers when MoE layers and dense ones
        alternate): all split by tp."""
        return self.attention_matrix_params + round(self.mlp_params / max(self.num_layers, 1))

    @functools.cached_property
    def inactive_params(self) -> int:
        """Expert parameters a token does not pass through (experts - top-k of every MoE layer): in memory, not in
        the FLOPs."""
        return len(self.moe_layers) * (self.num_experts - self.experts_per_token) * self.expert_params

    @functools.cached_property  # read for every stage of every layout a search costs
    def layer_norm_params(self) -> int:
        """The block's RMSNorm weights (two, four for Gemma) and a family's per-head q/k norms, replicated on every
        tp rank."""
        names = self.family.tensor_names
        per_head = names.qk_norm == QK_NORM_PER_HEAD and self.family.attention.params is None  # else in its own
        return names.hidden_norms * self.hidden_size + (2 * self.head_dim if per_head else 0)

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
        blocks = self.num_layers * (self.attention_matrix_params + self.layer_norm_params) + self.mlp_params
        return blocks + self.family_params + self.embedding_params + self.head_params + self.hidden_size

    @property
    def math_attention(self) -> bool:
        """Its attention materialises every score (soft-capped scores, a sink logit): no fused kernel takes it."""
        return bool(self.attn_logit_softcapping) or self.family.attention.sinks

    @functools.cached_property
    def family_params(self) -> int:
        """The family's own parameters of every block (Family.layer_params: gpt-oss's biases and sinks)."""
        return sum(math.prod(dims) for i in range(self.num_layers)
                   for dims in self.family.layer_params(self, i).values())

    @property
    def non_embedding_params(self) -> int:
        """N of the FLOP count: every parameter but the input embedding, which is a lookup, not a matmul. The output
        head is a matmul and counts (for tied embeddings the shared matrix counts once, as the head)."""
        return self.params - (0 if self.tie_embeddings else self.embedding_params)

    # ---- FLOPs

    @functools.cached_property  # read for every layout a search costs
    def flops_per_token(self) -> float:
        """Model FLOPs per token, forward + backward, PaLM's definition (Chowdhery et al. 2022, appendix B):
        6 N + 12 L h s, N = non_embedding_params (the matmul weights: 2 FLOPs per weight forward, 4 backward; of a
        mixture of experts the top-k experts a token passes through, not the inactive_params) and
        12 L h s the attention scores and their weighted sum (QK^T and AV, forward + backward, causal mask not
        discounted; h there is the query width q_dim, hidden for most families; a sliding-window layer counts its
        window instead of s when that is shorter: the keys it can see). Recomputation is hardware work,
        not model work, so it is not counted. The one definition of MFU everywhere: the training metric perf/mfu,
        the planner and scripts/bench_gpu.py."""
        spans = sum(self.attention_span(i) for i in range(self.num_layers))
        return 6.0 * (self.non_embedding_params - self.inactive_params) + 12.0 * self.q_dim * spans


def shape_fields(m: Any) -> dict[str, Any]:
    """ModelShape's fields from a `model` config section (or anything with its field names)."""
    heads = int(m.num_heads)
    kv = getattr(m, "num_kv_heads", None)
    ffn = getattr(m, "ffn_hidden_size", None)
    arch = getattr(m, "architecture", None) or families.DEFAULT.architecture
    family = families.find(str(arch)) or families.DEFAULT
    max_pos = getattr(m, "max_position_embeddings", None)
    rope = rope_fields(getattr(m, "rope_scaling", None), max_pos)
    # A shape-like object (a namespace rebuilt from asdict) carries the resolved fields themselves.
    for key in rope:
        if getattr(m, key, None) is not None:
            rope[key] = type(rope[key])(getattr(m, key))
    window = getattr(m, "sliding_window", None)
    local_theta, scalar = getattr(m, "rope_local_theta", None), getattr(m, "query_pre_attn_scalar", None)
    return dict(hidden_size=int(m.hidden_size), num_layers=int(m.num_layers), num_heads=heads,
              num_kv_heads=int(kv) if kv is not None else heads,
              ffn_hidden_size=int(ffn) if ffn is not None else default_ffn(int(m.hidden_size)),
              vocab_size=int(m.vocab_size), seq_len=int(m.seq_len), tie_embeddings=bool(m.tie_embeddings),
              rope_theta=float(getattr(m, "rope_theta", 10000.0)), norm_eps=float(getattr(m, "norm_eps", 1e-5)),
              init_std=float(getattr(m, "init_std", 0.02)), architecture=str(arch),
              qkv_bias=family.qkv_bias,
              max_position_embeddings=int(max_pos) if max_pos else None,
              head_dim=family.head_dim(int(m.hidden_size), heads, getattr(m, "head_dim", None)),
              hidden_act=str(getattr(m, "hidden_act", None) or family.keys.activations[0]),
              attention_kernel=str(getattr(m, "attention_kernel", None) or "auto"),
              sliding_window=int(window) if window else None,
              layer_types=tuple(str(t) for t in (getattr(m, "layer_types", None) or ())),
              rope_local_theta=float(local_theta) if local_theta else None,
              query_pre_attn_scalar=float(scalar) if scalar else None,
              attn_logit_softcapping=_optional_float(getattr(m, "attn_logit_softcapping", None)),
              final_logit_softcapping=_optional_float(getattr(m, "final_logit_softcapping", None)),
              partial_rotary_factor=float(getattr(m, "partial_rotary_factor", None) or 1.0),
              family_keys=own_keys(family, getattr(m, "family_keys", None)),
              image_path=image_path_of(getattr(m, "image_path", None)),
              **expert_fields(m, int(m.num_layers),
                              int(ffn) if ffn is not None else default_ffn(int(m.hidden_size))), **rope)


def image_path_of(given: Any) -> Optional[VisionShape]:
    """The model section's image path (a namespace rebuilt from asdict holds it as a mapping)."""
    if given is None or isinstance(given, VisionShape):
        return given
    return VisionShape(**dict(given))


def expert_fields(m: Any, num_layers: int, ffn: int) -> dict[str, Any]:
    """ModelShape's expert fields from a model section (nothing for a dense model)."""
    experts = int(getattr(m, "num_experts", 0) or 0)
    if not experts:
        return {}
    layers = getattr(m, "moe_layers", None)
    coef = getattr(m, "router_aux_loss_coef", None)
    return {"num_experts": experts, "experts_per_token": int(getattr(m, "experts_per_token", None) or 2),
            "expert_ffn_hidden_size": int(getattr(m, "expert_ffn_hidden_size", None) or ffn),
            "norm_topk_prob": bool(getattr(m, "norm_topk_prob", True)),
            "moe_layers": tuple(int(i) for i in layers) if layers is not None else tuple(range(num_layers)),
            "router_aux_loss_coef": float(coef) if coef is not None else 0.001}


def own_keys(family: Family, given: Any) -> tuple[tuple[str, Any], ...]:
    """The family's own keys of a model section's family_keys (a mapping, or the shape's pairs) that differ from
    the family's defaults; a key the family does not read is dropped here (the config checks refuse it)."""
    pairs = dict(given.items() if hasattr(given, "items") else (given or ()))
    return tuple(sorted((k, v) for k, v in pairs.items()
                        if k in family.keys.own and v != family.keys.own[k]))


def _optional_float(value: Any) -> Optional[float]:
    return float(value) if value else None


def rope_fields(scaling: Optional[dict[str, Any]], max_positions: Optional[int] = None) -> dict[str, Any]:
    """ModelShape's rope_* fields from a config.json-style rope_scaling mapping (None: plain RoPE). Unknown
    types are kept by name (the config checks report them); missing llama3 keys take Llama 3.1's values; a
    longrope factor left out is max_positions / the original context, as transformers takes it."""
    fields: dict[str, Any] = {"rope_type": "default", "rope_factor": 1.0, "rope_low_freq_factor": 1.0,
                              "rope_high_freq_factor": 4.0, "rope_original_max_positions": 0,
                              "rope_attention_factor": 0.0, "rope_beta_fast": 32.0, "rope_beta_slow": 1.0,
                              "rope_mscale": 0.0, "rope_mscale_all_dim": 0.0, "rope_truncate": True,
                              "rope_long_factor": (), "rope_short_factor": ()}
    if not scaling:
        return fields
    kind = str(scaling.get("rope_type", scaling.get("type", "default")))
    fields["rope_type"] = kind
    if kind == "default":
        return fields
    fields["rope_factor"] = float(scaling.get("factor", 1.0))
    fields["rope_low_freq_factor"] = float(scaling.get("low_freq_factor", 1.0))
    fields["rope_high_freq_factor"] = float(scaling.get("high_freq_factor", 4.0))
    fields["rope_original_max_positions"] = int(scaling.get("original_max_position_embeddings", 0) or 0)
    fields["rope_attention_factor"] = float(scaling.get("attention_factor") or 0.0)
    fields["rope_beta_fast"] = float(scaling.get("beta_fast") or 32.0)
    fields["rope_beta_slow"] = float(scaling.get("beta_slow") or 1.0)
    fields["rope_mscale"] = float(scaling.get("mscale") or 0.0)
    fields["rope_mscale_all_dim"] = float(scaling.get("mscale_all_dim") or 0.0)
    fields["rope_truncate"] = bool(scaling.get("truncate", True))
    fields["rope_long_factor"] = tuple(float(x) for x in scaling.get("long_factor") or ())
    fields["rope_short_factor"] = tuple(float(x) for x in scaling.get("short_factor") or ())
    original = fields["rope_original_max_positions"]
    if kind == "longrope" and scaling.get("factor") is None and max_positions and original:
        fields["rope_factor"] = float(max_positions) / original
    return fields
