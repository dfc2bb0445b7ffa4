"""What `model.adapter` means, without torch: which linear layers a target role names, the LoRA scale, and the
job checks (each problem names its key and the fix).

Roles are the same for every family: q, k, v, o of the attention and gate, up, down of the MLP, named after the
projections of transformers' Llama (q_proj ... down_proj). A family whose checkpoint fuses projections (Phi-3's
qkv_proj: q, k, v; gate_up_proj: gate, up) has one peft adapter per fused module: one A, one B over the stacked
rows. rayspeed keeps the parts as separate layers: their adapters share the one A (the first part's parameter)
and each holds its rows of B, which is that adapter exactly; so a fused module is targeted whole or not at all,
with one rank and alpha.

A mixture of experts: the attention roles adapt every block; the MLP roles none, the experts, the routers and
Qwen3-MoE's dense MLP blocks stay frozen. The reason is the contract with peft: peft 0.21 on transformers 5 maps
gate_proj, up_proj and down_proj of a MoE model onto the experts' stacked weights (LoRA on parameters) and then no
longer adapts a dense block's MLP, so an adapter of those roles would not load in peft as rayspeed trained it.
`all` means q, k, v, o there; naming gate, up or down is exit 2 (config.moe_keys).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Optional

ROLES: dict[str, str] = {
    "q": "attn.wq", "k": "attn.wk", "v": "attn.wv", "o": "attn.wo",
    "gate": "mlp.w_gate", "up": "mlp.w_up", "down": "mlp.w_down",
}
"""role -> the linear layer of a block it names (rayspeed's module path under layers.{i})."""
MLP_ROLES = ("gate", "up", "down")
"""The roles of a dense MLP: a mixture of experts' MoE blocks have none (their experts are not adapted)."""
COLUMN_ROLES = ("q", "k", "v", "gate", "up")
"""Column-parallel under tp (the output features split): the adapter's B is split by rows, A is whole."""
ALL = "all"
TRAINABLE = ("embed", "head", "norms")


def is_adapter(name: str) -> bool:
    """Whether rayspeed parameter `name` is an adapter's (`<layer>.adapter.lora_A` ...)."""
    return ".adapter." in name


def partition_dim(name: str) -> Optional[int]:
    """The dimension tensor parallelism splits adapter parameter `name` (`layers.{i}.<path>.adapter.<kind>`)
    along, as rayspeed.adapters.lora shards it (None: whole on every rank)."""
    layer, _, kind = name.partition(".adapter.")
    column = layer.split(".", 2)[-1] in {ROLES[r] for r in COLUMN_ROLES}
    if kind == "lora_A":
        return None if column else 1
    return 0 if column else None  # lora_B, magnitude: split like the output of a column layer


def fused_groups(family: Any) -> dict[str, tuple[str, ...]]:
    """The checkpoint's fused projections of `family` (their module names) -> the roles each stacks, in row order
    ({"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")} for Phi-3; {} for separate projections)."""
    if family is None:
        return {}
    by_path = {p: r for r, p in ROLES.items()}
    return {fused.split(".")[-2]: tuple(by_path[part[: -len(".weight")]] for part in parts)
            for fused, parts in family.tensor_names.fused.items()}


def shares_a(role: str, family: Any) -> bool:
    """Whether `role`'s adapter uses an earlier role's A (a later part of a fused projection)."""
    return any(role in g[1:] for g in fused_groups(family).values())


def a_owner(layer: str, family: Any) -> str:
    """The layer whose A the adapter of rayspeed layer `layer` (layers.{i}.<path>) uses: the first part of its
    fused projection, else itself."""
    role = role_of(layer)
    index = layer.split(".")[1]
    for group in fused_groups(family).values():
        if role in group[1:]:
            return f"layers.{index}.{ROLES[group[0]]}"
    return layer


def enabled(adapter: Any) -> bool:
    return adapter is not None and adapter.type != "none"


def target_roles(adapter: Any) -> tuple[str, ...]:
    """The roles an adapter covers, in ROLES' order (`all`: every one)."""
    wanted = set(adapter.targets)
    return tuple(r for r in ROLES if ALL in wanted or r in wanted)


def scale(adapter: Any, role: Optional[str] = None) -> float:
    """alpha / rank, or alpha / sqrt(rank) with rsLoRA (peft's `scaling`), of `role` (None: the defaults)."""
    r, alpha = role_rank(adapter, role), role_alpha(adapter, role)
    return float(alpha) / (math.sqrt(r) if adapter.rslora else r)


def role_rank(adapter: Any, role: Optional[str]) -> int:
    """The rank of `role`'s adapters: model.adapter.rank_pattern's, else rank."""
    return int((getattr(adapter, "rank_pattern", None) or {}).get(role, adapter.rank))


def role_alpha(adapter: Any, role: Optional[str]) -> float:
    return float((getattr(adapter, "alpha_pattern", None) or {}).get(role, adapter.alpha))


def role_of(layer: str) -> str:
    """The role of rayspeed layer `layers.{i}.<path>` (e.g. layers.0.attn.wq -> q)."""
    path = layer.split(".", 2)[-1]
    return next(r for r, p in ROLES.items() if p == path)


def role_dims(shape: Any) -> dict[str, tuple[int, int]]:
    """role -> (in, out) features of its linear layer in a model of `shape` (a ModelShape)."""
    h, q, kv, f = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.ffn_hidden_size
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, f), "up": (h, f), "down": (f, h)}


def role_layers(shape: Any, role: str) -> int:
    """How many blocks `role` adapts: every block, except the MLP roles of a mixture of experts (none: see the
    module doc)."""
    experts = int(getattr(shape, "num_experts", 0) or 0)
    return 0 if role in MLP_ROLES and experts > 0 else int(shape.num_layers)


def adapter_params(shape: Any, adapter: Any) -> int:
    """Adapter parameters of the whole model: rank x (in + out) per adapted layer, DoRA's magnitude (out) too."""
    dims = role_dims(shape)
    family = shape.family
    return sum(role_layers(shape, r) * (role_rank(adapter, r) * ((0 if shares_a(r, family) else dims[r][0])
                                                                + dims[r][1]) + (dims[r][1] if adapter.dora else 0))
               for r in target_roles(adapter))


def flops_per_token(shape: Any, adapter: Any) -> float:
    """Model FLOPs per token of a job (MFU's numerator, everywhere): ModelShape.flops_per_token, and with adapters
    the frozen projections' weight gradient (2 FLOPs per weight) left out, the adapters' 6 per parameter added."""
    if not enabled(adapter):
        return float(shape.flops_per_token)
    frozen = shape.non_embedding_params - getattr(shape, "inactive_params", 0)  # what a token passes through
    return shape.flops_per_token - 2.0 * frozen + 6.0 * adapter_params(shape, adapter)


def _family_problems(a: Any, family: Any) -> list[str]:
    """What the family's projections allow of the adapter: a fused projection has one adapter (its roles together,
    one rank and alpha); a latent attention has no q, k, v roles."""
    p: list[str] = []
    if family is not None and family.attention.params is not None:
        p.append(f"model.adapter: {family.architecture}'s attention is its own: the adapter roles are not mapped "
                 "onto its projections yet (latent attention's low-rank down- and up-projections); set "
                 "model.adapter.type: none, or fine-tune it fully")
    roles = set(target_roles(a))
    for module, group in fused_groups(family).items():
        if roles & set(group) and not set(group) <= roles:
            p.append(f"model.adapter.targets: {family.architecture} fuses {', '.join(group)} in one projection "
                     f"({module}), which has one adapter; target all of {', '.join(group)} or none")
        for key, pattern in (("rank_pattern", a.rank_pattern), ("alpha_pattern", a.alpha_pattern)):
            values = {r: pattern.get(r) for r in group}
            if len(set(values.values())) > 1:
                p.append(f"model.adapter.{key}: {values} differ within {module}, one adapter on "
                         f"{family.architecture}; give {', '.join(group)} the same value")
    return p


def problems(cfg: Any, family: Any) -> list[str]:
    a = cfg.model.adapter
    if not enabled(a):
        return []
    p: list[str] = []
    if a.rank < 1:
        p.append(f"model.adapter.rank: must be >= 1, got {a.rank}")
    if a.alpha <= 0:
        p.append(f"model.adapter.alpha: must be > 0, got {a.alpha}")
    if not 0.0 <= a.dropout < 1.0:
        p.append(f"model.adapter.dropout: must be in [0, 1), got {a.dropout}")
    if a.lora_plus_ratio < 0:
        p.append(f"model.adapter.lora_plus_ratio: must be >= 0 (0: off; LoRA+ suggests 16), got {a.lora_plus_ratio}")
    for key, pattern in (("rank_pattern", a.rank_pattern), ("alpha_pattern", a.alpha_pattern)):
        outside = sorted(set(pattern) - set(target_roles(a)))
        if outside:
            p.append(f"model.adapter.{key}: {outside} are not among the targeted roles "
                     f"({', '.join(target_roles(a))}); name targeted roles only")
        low = {k: v for k, v in pattern.items() if (v < 1 if key == "rank_pattern" else v <= 0)}
        if low:
            p.append(f"model.adapter.{key}: {low} must be {'>= 1' if key == 'rank_pattern' else '> 0'}")
    unknown = [t for t in a.targets if t != ALL and t not in ROLES]
    if unknown or not a.targets:
        p.append(f"model.adapter.targets: {unknown or '[]'} is not a list of roles; use all, or some of "
                 f"{', '.join(ROLES)}")
    bad = [t for t in a.trainable if t not in TRAINABLE]
    if bad:
        p.append(f"model.adapter.trainable: {bad} unknown; use some of {', '.join(TRAINABLE)}")
    p += _family_problems(a, family)
    p += _nf4_problems(cfg)
    if a.dora and cfg.parallel.zero_stage == 3:
        p.append("model.adapter.dora: DoRA reads each whole base weight every forward, which ZeRO-3 partitions; "
                 "use parallel.zero_stage 0, 1 or 2 (or auto), or set dora: false")
    return p


def _nf4_problems(cfg: Any) -> list[str]:
    a = cfg.model.adapter
    if a.base_precision != "nf4":
        return ([f"model.adapter.compute_dtype: {a.compute_dtype} applies to 4-bit base weights only; set "
                 "base_precision: nf4 or remove compute_dtype"] if a.compute_dtype != "auto" else [])
    if cfg.parallel.zero_stage == 3:
        return ["model.adapter.base_precision: nf4 packs the base weights in 4 bits, which ZeRO-3 does not "
                "partition; use parallel.zero_stage 0, 1 or 2 (or auto)"]
    return []


PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def fully_trained(name: str, adapter: Any, shape: Any) -> bool:
    """Whether rayspeed parameter `name` trains in full beside the adapters (model.adapter.trainable)."""
    which = set(getattr(adapter, "trainable", ()) or ())
    if name == "embed.weight":
        return "embed" in which or ("head" in which and shape.tie_embeddings)
    if name == "head.weight":
        return "head" in which and not shape.tie_embeddings
    return "norms" in which and name.endswith("norm.weight")


def full_module_name(key: str, shape: Any) -> Optional[str]:
    """The rayspeed parameter of a PEFT file's key for a module trained in full (peft's modules_to_save, under the
    checkpoint's names, the adapter name dropped), or None (a LoRA tensor, or nothing of this model). A tied head is
    the embedding."""
    if not key.startswith(PEFT_PREFIX) or ".lora_" in key:
        return None
    hf = key[len(PEFT_PREFIX):].replace(".modules_to_save.default.", ".").replace(".modules_to_save.", ".")
    name = shape.family.tensor_names.rayspeed_name(hf)
    if name == "head.weight" and shape.tie_embeddings:
        return "embed.weight"
    return name


def safetensors_keys(path: str) -> list[str]:
    """The tensor names of a safetensors file, from its JSON header (no tensor is read; no torch)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return [k for k in header if k != "__metadata__"]


def init_adapter_dir(cfg: Any) -> Optional[str]:
    """train.init_from when it names a PEFT adapter folder (adapter_config.json: made by peft, TRL, Axolotl or
    `rayspeed export --format peft`): the job continues that adapter on model.pretrained's weights. None: no
    init_from, or a model to warm-start from (its weights become the base)."""
    spec = getattr(cfg.train, "init_from", None)
    if not spec or "://" in str(spec) or str(spec).startswith(("models:/", "runs:/")):
        return None
    return str(spec) if os.path.isfile(os.path.join(str(spec), PEFT_CONFIG)) else None


def base_source(cfg: Any) -> str:
    """Where an adapter job's base weights come from: a warm start's model (train.init_from), else model.pretrained
    (also when init_from is a PEFT adapter, which continues on it)."""
    init = getattr(cfg.train, "init_from", None)
    return str(cfg.model.pretrained or "") if (not init or init_adapter_dir(cfg)) else str(init)


def init_adapter_problems(cfg: Any, shape: Any) -> list[str]:
    """A PEFT adapter named by train.init_from against the job's model.adapter: each setting that shapes or scales
    the adapter must be the same (the job's key and the adapter's value named), model.pretrained set."""
    folder = init_adapter_dir(cfg)
    if folder is None:
        return []
    where = f"train.init_from {folder}"
    try:
        peft = json.loads(open(os.path.join(folder, PEFT_CONFIG)).read())
    except (OSError, ValueError) as e:
        return [f"{where}: {PEFT_CONFIG} cannot be read ({e})"]
    a = cfg.model.adapter
    if not enabled(a):
        return [f"{where} is a PEFT adapter: set model.adapter (type: lora, rank: {peft.get('r')}, alpha: "
                f"{peft.get('lora_alpha')}) to continue it, or point init_from at a model"]
    p = []
    if not cfg.model.pretrained:
        p.append(f"{where}: a PEFT adapter continues on its base model; set model.pretrained to it "
                 f"(the adapter names {peft.get('base_model_name_or_path')!r})")
    if peft.get("peft_type", "LORA") != "LORA":
        p.append(f"{where}: a {peft.get('peft_type')} adapter; rayspeed continues LoRA adapters only")
    names = shape.family.tensor_names

    def leaf(role: str) -> str:
        return names.hf_name(f"layers.0.{ROLES[role]}.weight").split(".")[-2]

    targets = peft.get("target_modules") or []
    targets = sorted([targets] if isinstance(targets, str) else targets)
    want = {
        "model.adapter.rank": (a.rank, peft.get("r")),
        "model.adapter.alpha": (float(a.alpha), float(peft.get("lora_alpha", 8))),
        "model.adapter.targets": (sorted({leaf(r) for r in target_roles(a) if role_layers(shape, r)}), targets),
        "model.adapter.rslora": (bool(a.rslora), bool(peft.get("use_rslora", False))),
        "model.adapter.dora": (bool(a.dora), bool(peft.get("use_dora", False))),
        "model.adapter.rank_pattern": ({leaf(r): v for r, v in a.rank_pattern.items()}, peft.get("rank_pattern") or {}),
        "model.adapter.alpha_pattern": ({leaf(r): float(v) for r, v in a.alpha_pattern.items()},
                                        {k: float(v) for k, v in (peft.get("alpha_pattern") or {}).items()}),
    }
    for key, (job, theirs) in want.items():
        if job != theirs:
            p.append(f"{key}: {job!r} here, {theirs!r} in {where}; set it to the adapter's")
    if peft.get("modules_to_save"):  # the same modules in full here as in the adapter's file
        from rayspeed.config.hf_checkpoint import param_shapes

        try:
            keys = safetensors_keys(os.path.join(folder, PEFT_WEIGHTS))
        except (OSError, ValueError) as e:
            return p + [f"{where}: {PEFT_WEIGHTS} cannot be read ({e})"]
        theirs_full = {n for n in (full_module_name(k, shape) for k in keys) if n is not None}
        mine = {n for n in param_shapes(shape) if fully_trained(n, a, shape)}
        if theirs_full != mine:
            def kinds(names: set) -> list[str]:
                return sorted({"embed" if n == "embed.weight" else "head" if n == "head.weight" else "norms"
                               for n in names})
            p.append(f"model.adapter.trainable: {kinds(mine)} here, {kinds(theirs_full)} trained in full in {where} "
                     f"(modules_to_save {peft['modules_to_save']}); set model.adapter.trainable to the adapter's")
    return p
