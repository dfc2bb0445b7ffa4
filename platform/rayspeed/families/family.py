"""What makes a model family itself, in one frozen record: the Hugging Face names, what its config.json holds and
what rayspeed accepts of it, the checkpoint's tensor names, and the shape rules. Pure Python, below the config.

A record is data: names, config keys and defaults, the tensor name map (which says which tensors a block has and how
tensor parallelism splits each, so the parameter count and the checkpoint's tensor list follow from it), the shape
rule. How a family computes is not here: its model module (rayspeed.model.families.<name>) composes parts, and a
family without one is the Llama decoder. Code elsewhere asks the record instead of comparing architecture names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

# Sliding-window policies: which layers of a config.json attend within a window, as transformers reads it.
SLIDING_NONE = "none"  # the family has no sliding window (a `sliding_window` key is refused)
SLIDING_ALL_LAYERS = "all_layers"  # `sliding_window` (null: none) applies to every layer (Mistral)
SLIDING_USE_FLAG = "use_flag"  # only with `use_sliding_window`; layers from `max_window_layers` on (Qwen2, Qwen3)
SLIDING_LAYER_TYPES = "layer_types"  # `layer_types`, else every `sliding_window_pattern`-th layer global (Gemma 3)
SLIDING_POLICIES = (SLIDING_NONE, SLIDING_ALL_LAYERS, SLIDING_USE_FLAG, SLIDING_LAYER_TYPES)

# Layer types, config.json's names.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

# MLP activations (config.json's names) and what the decoder computes for each.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

# Optional config.json keys, each read only by a family whose ConfigKeys name it (another family's file must not
# carry it: it would change nothing, silently).
HEAD_DIM_KEY = "head_dim"  # the head width, instead of hidden / heads (the query width is then heads * head_dim)
SOFTCAP_KEYS = ("attn_logit_softcapping", "final_logit_softcapping")
QUERY_SCALE_KEY = "query_pre_attn_scalar"  # the attention scale s^-0.5 instead of head_dim^-0.5
PARTIAL_ROTARY_KEY = "partial_rotary_factor"  # RoPE rotates only this share of each head
LOCAL_ROPE_KEY = "rope_local_base_freq"  # sliding-window layers' own RoPE base (or rope_parameters per layer type)
OPTIONAL_KEYS = (HEAD_DIM_KEY, *SOFTCAP_KEYS, QUERY_SCALE_KEY, PARTIAL_ROTARY_KEY, LOCAL_ROPE_KEY)

# What a q/k norm normalises over, as the tensor name map says it (TensorNames.qk_norm).
QK_NORM_PER_HEAD = "head"  # a weight of head_dim, whole on every tp rank (Qwen3, Gemma 3)
QK_NORM_PER_PROJECTION = "projection"  # heads x head_dim wide, split by tp with the heads (OLMo 2)

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")
EXPERT_STACK = re.compile(r"^layers\.\d+\.mlp\.[a-z_]+$")  # layers.i.mlp.w_gate: no .weight, one row per expert


def is_expert_stack(name: str) -> bool:
    """A MoE layer's per-expert stack (experts first: what expert parallelism shards), by its name."""
    return bool(EXPERT_STACK.match(name))


def frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    """A read-only view, so a record's tables cannot be changed by whoever reads them."""
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class TensorNames:
    """rayspeed parameter name <-> checkpoint tensor name, with the dimension tensor parallelism splits each
    along (0: rows, column-parallel and the vocabulary; 1: columns, row-parallel; None: replicated)."""
    top: Mapping[str, tuple[str, Optional[int]]]
    """Parameters outside the blocks: rayspeed name -> (checkpoint name, tp dim)."""
    in_layer: Mapping[str, tuple[str, Optional[int]]]
    """Parameters of block i, without the `layers.<i>.` prefix: rayspeed suffix -> (checkpoint suffix, tp dim)."""
    layer_prefix: str = "model.layers."
    """The checkpoint's prefix of block i's tensors (followed by `<i>.`)."""
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: frozen({}))
    """Checkpoint tensors of block i that hold several rayspeed parameters stacked along rows (Phi-3's qkv_proj:
    q, k, v; gate_up_proj: gate, up): checkpoint suffix -> the rayspeed suffixes in row order. Their in_layer
    entries name the fused tensor; the loader reads each rank's rows of each part, the export concatenates."""

    experts: Mapping[str, tuple[str, Optional[int]]] = field(default_factory=lambda: frozen({}))
    """The expert weights of a MoE block i, stacked [experts, out, in] in rayspeed, one tensor per expert in the
    hub's checkpoints: rayspeed suffix -> (checkpoint suffix with `{e}` for the expert, the dimension of one expert's
    matrix that tensor parallelism would split)."""

    def expert_names(self, name: str, num_experts: int) -> list[str]:
        """The checkpoint's per-expert tensors of stacked parameter `name`, expert 0 first ([]: not an expert
        parameter)."""
        m = LAYER_NAME.match(name)
        entry = self.experts.get(m.group(2)) if m else None
        if entry is None or m is None:
            return []
        return [f"{self.layer_prefix}{m.group(1)}.{entry[0].format(e=e)}" for e in range(num_experts)]

    def hf_name(self, name: str) -> str:
        """The checkpoint's name of rayspeed parameter `name` (KeyError for a name with no counterpart)."""
        if name in self.top:
            return self.top[name][0]
        m = LAYER_NAME.match(name)
        if not m:
            raise KeyError(name)
        return f"{self.layer_prefix}{m.group(1)}.{self.in_layer[m.group(2)][0]}"

    def rayspeed_name(self, hf: str) -> Optional[str]:
        """rayspeed's name of checkpoint tensor `hf`, or None when rayspeed has no such parameter."""
        for name, (hf_top, _) in self.top.items():
            if hf == hf_top:
                return name
        if hf.startswith(self.layer_prefix):
            index, _, rest = hf[len(self.layer_prefix):].partition(".")
            for suffix, (hf_suffix, _) in self.in_layer.items():
                if index.isdigit() and rest == hf_suffix:
                    return f"layers.{index}.{suffix}"
        return None

    def fused_parts(self, hf: str) -> tuple[str, ...]:
        """rayspeed's names of the parameters stacked in checkpoint tensor `hf`, in row order (empty: not fused)."""
        if not hf.startswith(self.layer_prefix):
            return ()
        index, _, rest = hf[len(self.layer_prefix):].partition(".")
        return tuple(f"layers.{index}.{suffix}" for suffix in self.fused.get(rest, ()))

    @property
    def hidden_norms(self) -> int:
        """Norms over the hidden width in a block: 2 (before attention and the MLP), 4 with Gemma's post-norms."""
        return sum(1 for k in self.in_layer if k.endswith("norm.weight") and not k.startswith("attn."))

    @property
    def qk_norm(self) -> Optional[str]:
        """What the block's q/k norms run over (QK_NORM_PER_HEAD, QK_NORM_PER_PROJECTION), None: none."""
        entry = self.in_layer.get("attn.q_norm.weight")
        if entry is None:
            return None
        return QK_NORM_PER_HEAD if entry[1] is None else QK_NORM_PER_PROJECTION

    @property
    def qkv_bias(self) -> bool:
        """q, k and v carry biases."""
        return "attn.wq.bias" in self.in_layer

    def partition_dim(self, name: str) -> Optional[int]:
        """The dimension tensor parallelism splits rayspeed parameter `name` along (None: replicated)."""
        if name in self.top:
            return self.top[name][1]
        m = LAYER_NAME.match(name)
        entry = self.in_layer.get(m.group(2)) if m else None
        return entry[1] if entry else None



def llama_tensor_names(qkv_bias: bool = False) -> TensorNames:
    """transformers' Llama naming, which Mistral and Qwen2 (with q/k/v biases) share (the same as the layers in
    parallel/layers.py: q/k/v, gate and up column-parallel, o and down row-parallel, norms replicated)."""
    in_layer: dict[str, tuple[str, Optional[int]]] = {
        "attn_norm.weight": ("input_layernorm.weight", None),
        "mlp_norm.weight": ("post_attention_layernorm.weight", None),
        "mlp.w_gate.weight": ("mlp.gate_proj.weight", 0),
        "mlp.w_up.weight": ("mlp.up_proj.weight", 0),
        "mlp.w_down.weight": ("mlp.down_proj.weight", 1),
    }
    for p in "qkv":
        for kind in ("weight", "bias") if qkv_bias else ("weight",):
            in_layer[f"attn.w{p}.{kind}"] = (f"self_attn.{p}_proj.{kind}", 0)
    in_layer["attn.wo.weight"] = ("self_attn.o_proj.weight", 1)
    top = {"embed.weight": ("model.embed_tokens.weight", 0), "norm.weight": ("model.norm.weight", None),
           "head.weight": ("lm_head.weight", 0)}
    return TensorNames(top=frozen(top), in_layer=frozen(in_layer))


@dataclass(frozen=True)
class ExpertKeys:
    """A mixture-of-experts family's config.json keys."""
    experts: str
    """The number of routed experts (Qwen3-MoE: num_experts, Mixtral: num_local_experts)."""
    expert_ffn: Optional[str] = None
    """One expert's inner width (Qwen3-MoE: moe_intermediate_size); None: intermediate_size."""
    norm_topk: Optional[str] = None
    """Whether the top-k weights are renormalised (Qwen3-MoE: norm_topk_prob, default False); None: always."""
    sparse_step: Optional[str] = None
    """Every sparse_step-th layer is MoE (Qwen3-MoE: decoder_sparse_step), less `dense_layers`; None: every layer."""
    dense_layers: Optional[str] = None
    """Layers kept dense (Qwen3-MoE: mlp_only_layers)."""
    first_dense: Optional[str] = None
    """How many layers from the first are dense (DeepSeek-V3: first_k_dense_replace)."""

    def moe_layers(self, hf: Mapping[str, Any], num_layers: int) -> list[int]:
        """The MoE layers a config.json describes, as transformers builds them."""
        step = int(hf.get(self.sparse_step) or 1) if self.sparse_step else 1
        dense = set(hf.get(self.dense_layers) or []) if self.dense_layers else set()
        first = int(hf.get(self.first_dense) or 0) if self.first_dense else 0
        return [i for i in range(first, num_layers) if i not in dense and (i + 1) % step == 0]


def no_extras(shape: Any) -> dict[str, Any]:
    return {}


def no_layer_params(shape: Any, layer: int) -> dict[str, tuple[int, ...]]:
    return {}


@dataclass(frozen=True)
class StoredForms:
    """Parameters a checkpoint does not hold one tensor each: every expert's matrices in one tensor with two of
    them interleaved (gpt-oss's gate_up_proj), or packed in 4 bits with their scales (MXFP4). The record says which
    parameters and what a checkpoint may hold (torch-free: the header check and `rayspeed plan` read it); the
    family's model module reads and writes the tensors (its Composition's `weights`)."""
    converted: Callable[[Any], tuple[str, ...]]
    """The rayspeed parameters (full names) held this way, given the ModelShape."""
    forms: Callable[[Any], tuple[Mapping[str, tuple[int, ...]], ...]]
    """The checkpoint tensors (name -> shape) of each form the family's checkpoints come in, the one an export
    writes first; a checkpoint holds all of one form."""


@dataclass(frozen=True)
class ConfigKeys:
    """What a family's config.json may hold beyond the keys every family has, and what rayspeed accepts of it."""
    required: tuple[str, ...] = REQUIRED_KEYS
    """Keys without which the shape is unknown."""
    optional: tuple[str, ...] = ()
    """OPTIONAL_KEYS the family reads (config.json's head_dim, soft-capping, ...); the others are refused."""
    activation: str = "hidden_act"
    """The key naming the MLP activation (Gemma's is hidden_activation)."""
    activations: tuple[str, ...] = ("silu",)
    """The activations accepted, the first the default."""
    rope_types: tuple[str, ...] = ROPE_TYPES
    """RoPE scalings accepted."""
    sliding_window: str = SLIDING_NONE
    """What config.json may say about sliding-window attention (one of SLIDING_POLICIES)."""
    own: Mapping[str, Any] = field(default_factory=lambda: frozen({}))
    """config.json keys only this family reads, with their defaults (gpt-oss's swiglu_limit): model.pretrained
    fills them into model.family_keys, the shape carries them (ModelShape.family_key), an export writes them."""

    def reads(self, key: str) -> bool:
        return key in self.optional


@dataclass(frozen=True)
class AttentionForm:
    """A family's attention where it is not the shared one."""
    params: Optional[Callable[[Any], dict[str, tuple[int, ...]]]] = None
    """The block's attention parameters (suffix after `layers.<i>.` -> full shape) when they are not the shared
    q, k, v, o (DeepSeek-V3's latent attention: its down- and up-projections and their norms); None: the shared."""
    sinks: bool = False
    """Each head's softmax has a learned sink logit (gpt-oss): math attention (every score materialised, as the
    planner counts), and no context parallelism (the sink would have to join ring attention's merge: not built)."""


SHARED_ATTENTION = AttentionForm()


@dataclass(frozen=True)
class Family:
    """One model family as rayspeed reads and writes it."""
    architectures: tuple[str, ...]
    """Hugging Face architecture names (config.json's `architectures`); the first is the one an export writes."""
    model_type: str
    """config.json's `model_type`."""
    tensor_names: TensorNames = field(default_factory=llama_tensor_names)
    """The checkpoint name map: which tensors a block has, their names and tp dimensions."""
    defaults: Mapping[str, Any] = field(default_factory=lambda: frozen(
        {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "hidden_act": "silu"}))
    """config.json defaults of the family's transformers config class, for keys a file may omit."""
    keys: ConfigKeys = field(default_factory=ConfigKeys)
    """What its config.json may hold."""
    export_extras: Callable[[Any], dict[str, Any]] = no_extras
    """The family's own config.json keys an export writes, given the ModelShape."""
    moe: Optional["ExpertKeys"] = None
    """How the family's config.json describes its experts (None: the family has none)."""
    multimodal: tuple[str, ...] = ()
    """Architectures whose config.json nests this family's text model under `text_config` (Gemma 3's
    Gemma3ForConditionalGeneration): rayspeed reads and trains that text model and keeps the vision weights out;
    an export is this family's text-only architecture."""
    layer_params: Callable[[Any, int], dict[str, tuple[int, ...]]] = no_layer_params
    """Block i's parameters beyond the shared ones (suffix after `layers.<i>.` -> full shape), given the shape:
    the checkpoint's tensors (their names in tensor_names) and the parameter count follow from it."""
    stored: Optional[StoredForms] = None
    """Parameters the checkpoint holds otherwise than one tensor each (None: all one tensor each)."""
    attention: "AttentionForm" = field(default_factory=lambda: SHARED_ATTENTION)
    """What the family's attention holds beyond the shared q, k, v, o and their softmax."""
    norms_keep_fp32: bool = False
    """For the planner's activation memory only: the family's norms apply their weight to the fp32 normalised
    tensor, which backward then keeps (Gemma's (1 + w), OLMo 2's order). The model's norms are its module's parts;
    tests/planner/test_activation_memory.py holds the two to the bytes autograd saves."""

    def __post_init__(self) -> None:
        # A record rayspeed cannot read is a mistake in the record, caught at import.
        k = self.keys
        if k.sliding_window not in SLIDING_POLICIES:
            raise ValueError(f"{self.model_type}: sliding_window {k.sliding_window!r} is not one of "
                             f"{SLIDING_POLICIES}")
        unknown = [a for a in k.activations if a not in ACTIVATIONS] + [o for o in k.optional
                                                                         if o not in OPTIONAL_KEYS]
        if unknown:
            raise ValueError(f"{self.model_type}: {unknown} are not among the activations {ACTIVATIONS} or the "
                             f"optional keys {OPTIONAL_KEYS}")

    @property
    def architecture(self) -> str:
        return self.architectures[0]

    @property
    def tie_embeddings_default(self) -> bool:
        return bool(self.defaults["tie_word_embeddings"])

    @property
    def qkv_bias(self) -> bool:
        return self.tensor_names.qkv_bias

    def head_dim(self, hidden_size: int, num_heads: int, given: Optional[int] = None) -> int:
        """The attention head width: hidden/heads, or `given` (config.json's head_dim) where the family reads it."""
        if self.keys.reads(HEAD_DIM_KEY) and given:
            return int(given)
        return hidden_size // num_heads if num_heads else 0

    def query_width(self, num_heads: int, head_dim: int) -> int:
        """Width of q and of the output projection's input (the planner's q/o width)."""
        return num_heads * head_dim


def layer_types_of(shape: Any) -> list[str]:
    """Every layer's type as config.json names them (a shape without a window: all full attention)."""
    return [SLIDING_ATTENTION if shape.window_of(i) else FULL_ATTENTION for i in range(shape.num_layers)]


def use_flag_extras(shape: Any) -> dict[str, Any]:
    """Qwen2's and Qwen3's sliding-window keys: the flag, the window, the first sliding layer and the layer types
    (transformers 5 reads layer_types; max_window_layers says the same to transformers 4 when the sliding layers
    are the last ones)."""
    types = layer_types_of(shape)
    sliding = [i for i, t in enumerate(types) if t == SLIDING_ATTENTION]
    return {"use_sliding_window": bool(sliding), "sliding_window": shape.sliding_window if sliding else None,
            "max_window_layers": sliding[0] if sliding else shape.num_layers, "layer_types": types}
