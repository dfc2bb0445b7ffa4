"""Every check of a job that needs no cluster, as pure functions: each problem names its key and the fix.

Every command runs them (`rayspeed plan` as well as a training launch), so a bad value exits 2 before anything
starts instead of failing a worker later.
"""

from __future__ import annotations

import math
import re
from typing import Any

from rayspeed import families
from rayspeed.config import adapter, eval_keys, grpo_keys, job_checks, objective_keys
from rayspeed.config.env_lint import lint_env
from rayspeed.config.job_checks import sequence_parallel_problem
from rayspeed.config.names import name_problems, registered_name_problems
from rayspeed.config.schema import JobConfig
from rayspeed.config.shape import ModelShape
from rayspeed.families.family import (
    FULL_ATTENTION,
    HEAD_DIM_KEY,
    LAYER_TYPES,
    LOCAL_ROPE_KEY,
    PARTIAL_ROTARY_KEY,
    QUERY_SCALE_KEY,
    SLIDING_ALL_LAYERS,
    SLIDING_ATTENTION,
    SLIDING_NONE,
)

CALLBACK_NAME = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*")



def head_dim_problems(m: Any, family: families.Family) -> list[str]:
    """An explicit model.head_dim: positive, even for RoPE, and hidden_size / num_heads unless the family reads
    its own."""
    if m.head_dim < 1 or m.head_dim % 2:
        return [f"model.head_dim: must be a positive even number (RoPE rotates pairs), got {m.head_dim}"]
    if m.num_heads >= 1 and family.head_dim(m.hidden_size, m.num_heads, m.head_dim) != m.head_dim:
        return [f"model.head_dim: {m.head_dim} differs from hidden_size / num_heads = {m.hidden_size // m.num_heads}, "
                f"which {family.architecture} requires; drop model.head_dim"]
    return []



def default_sequence_parallel(seq_len: int, tp: int) -> bool:
    """parallel.sequence_parallel: auto: on with tp > 1, unless the sequence does not split over tp ranks."""
    return tp > 1 and sequence_parallel_problem(seq_len, tp) is None


def extended_rope_problems(m: Any, kind: str) -> list[str]:
    """yarn and longrope: the original context they scale from, and longrope's one factor per pair of dims."""
    if kind not in ("yarn", "longrope"):
        return []
    if not m.rope_scaling.get("original_max_position_embeddings"):
        return [f"model.rope_scaling: {kind} needs original_max_position_embeddings (the pretraining context)"]
    if kind == "yarn" or m.num_heads < 1:
        return []
    half = int((m.head_dim or m.hidden_size // m.num_heads) * (m.partial_rotary_factor or 1.0)) // 2
    return [f"model.rope_scaling: longrope {key} must give {half} factors (head_dim / 2), got "
            f"{len(m.rope_scaling.get(key) or ())}"
            for key in ("long_factor", "short_factor") if len(m.rope_scaling.get(key) or ()) != half]


def attention_problems(m: Any, family: families.Family) -> list[str]:
    """The activation, sliding window, layer types, local RoPE base and attention scale against what the family
    runs."""
    p: list[str] = []
    arch = family.architecture
    if m.hidden_act is not None and m.hidden_act not in family.keys.activations:
        p.append(f"model.hidden_act: {m.hidden_act!r} is not supported for {arch}; supported: "
                 f"{', '.join(family.keys.activations)}")
    if m.sliding_window is not None:
        if family.keys.sliding_window == SLIDING_NONE:
            p.append(f"model.sliding_window: {arch} has no sliding-window attention; drop model.sliding_window")
        elif m.sliding_window < 1:
            p.append(f"model.sliding_window: must be >= 1 (or null: no window), got {m.sliding_window}")
    if m.layer_types is not None:
        wrong = sorted({str(t) for t in m.layer_types} - set(LAYER_TYPES))
        if len(m.layer_types) != m.num_layers or wrong:
            p.append(f"model.layer_types: one of {', '.join(LAYER_TYPES)} per layer ({m.num_layers}), got "
                     f"{len(m.layer_types)} entries" + (f" with {', '.join(wrong)}" if wrong else ""))
        elif SLIDING_ATTENTION in m.layer_types and m.sliding_window is None:
            p.append("model.layer_types: sliding_attention layers need model.sliding_window")
        elif family.keys.sliding_window == SLIDING_ALL_LAYERS and FULL_ATTENTION in m.layer_types:
            p.append(f"model.layer_types: {arch} slides on every layer (transformers ignores layer_types for it); "
                     "drop model.layer_types")
    if m.partial_rotary_factor not in (None, 1, 1.0):
        head = m.head_dim or (m.hidden_size // m.num_heads if m.num_heads >= 1 else 0)
        if not family.keys.reads(PARTIAL_ROTARY_KEY):
            p.append(f"model.partial_rotary_factor: {arch} rotates the whole head; drop model.partial_rotary_factor")
        elif not 0 < m.partial_rotary_factor <= 1 or int(head * m.partial_rotary_factor) % 2:
            p.append(f"model.partial_rotary_factor: {m.partial_rotary_factor} of head_dim {head} must be in (0, 1] "
                     "and give an even number of rotated dimensions")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = getattr(m, key)
        if value is not None and (not family.keys.reads(key) or value <= 0):
            p.append(f"model.{key}: soft-capping must be > 0 and is read by a family that has it ({arch} "
                     f"{'has' if family.keys.reads(key) else 'has not'}); got {value}")
    if m.rope_local_theta is not None and not family.keys.reads(LOCAL_ROPE_KEY):
        p.append(f"model.rope_local_theta: {arch} has one RoPE base for every layer; drop model.rope_local_theta")
    if m.query_pre_attn_scalar is not None and not family.keys.reads(QUERY_SCALE_KEY):
        p.append(f"model.query_pre_attn_scalar: {arch} scales attention by head_dim^-0.5; drop "
                 "model.query_pre_attn_scalar")
    elif m.query_pre_attn_scalar is not None and m.query_pre_attn_scalar <= 0:
        p.append(f"model.query_pre_attn_scalar: must be > 0, got {m.query_pre_attn_scalar}")
    return p


def shape_split_problems(shape: ModelShape, tp: int, sequence_parallel: bool) -> list[str]:
    """What stops this model shape from being split over tp ranks: the one divisibility check that the config,
    the planner and the model builder share."""
    problems = []
    if shape.hidden_size % shape.num_heads and not shape.family.keys.reads(HEAD_DIM_KEY):  # else head_dim is given
        problems.append(f"hidden_size={shape.hidden_size} must divide by num_heads={shape.num_heads}")
    if shape.head_dim % 2:
        problems.append(f"head dim {shape.head_dim} must be even for RoPE")
    if shape.num_heads % shape.num_kv_heads:
        problems.append(f"num_heads={shape.num_heads} must divide by num_kv_heads={shape.num_kv_heads}")
    for name, value in (("num_heads", shape.num_heads), ("num_kv_heads", shape.num_kv_heads),
                        ("ffn_hidden_size", shape.ffn_hidden_size), ("vocab_size", shape.vocab_size),
                        ("expert_ffn_hidden_size", shape.expert_ffn_hidden_size)):
        if value % tp:
            problems.append(f"{name}={value} must divide by the tensor-parallel size tp={tp}")
    sp = sequence_parallel_problem(shape.seq_len, tp) if sequence_parallel else None
    if sp:
        problems.append(sp)
    return problems


def check(cfg: JobConfig, lint_cluster_env: bool = True) -> list[str]:
    """Every check that needs no cluster: cross-field arithmetic, storage, chaos, the health section and (unless the
    caller is the lint itself: `rayspeed doctor --env`) the linted cluster.env. All problems, not the first, in the
    order of the sections."""
    p = name_problems(cfg.name) + registered_name_problems(cfg.tracking.register_model) + number_problems(cfg)
    p += model_problems(cfg) + data_problems(cfg) + adapter.problems(cfg, families.find(cfg.model.architecture))
    p += objective_keys.problems(cfg) + grpo_keys.problems(cfg) + eval_keys.problems(cfg)
    p += job_checks.train_problems(cfg)
    p += job_checks.parallel_problems(cfg) + job_checks.cluster_problems(cfg) + job_checks.resilience_problems(cfg)
    p += job_checks.storage_problems(cfg) + job_checks.chaos_problems(cfg)
    p += [f"train.callbacks: {name!r} is not `package.module:Class` (e.g. mypkg.hooks:PrintLoss)"
          for name in cfg.train.callbacks if not CALLBACK_NAME.fullmatch(str(name))]
    return p + health_problems(cfg, lint_cluster_env)




def model_problems(cfg: JobConfig) -> list[str]:
    """The model section: sizes, heads, positions, the family's keys, RoPE scaling."""
    p: list[str] = []
    m = cfg.model
    kv = m.num_kv_heads if m.num_kv_heads is not None else m.num_heads
    for key in ("hidden_size", "num_layers", "num_heads", "vocab_size", "seq_len"):
        if getattr(m, key) < 1:
            p.append(f"model.{key}: must be >= 1, got {getattr(m, key)}")
    if m.head_dim is not None:  # a family that reads it (family_problems): the head width is the given one
        if m.head_dim % 2:
            p.append(f"model.head_dim ({m.head_dim}) must be even for RoPE")
    elif m.num_heads >= 1 and m.hidden_size % m.num_heads:
        p.append(f"model.hidden_size ({m.hidden_size}) must be divisible by model.num_heads ({m.num_heads})")
    elif m.num_heads >= 1 and (m.hidden_size // m.num_heads) % 2:
        p.append(f"model: head dim hidden_size/num_heads = {m.hidden_size // m.num_heads} must be even for RoPE")
    if kv < 1 or (m.num_heads >= 1 and m.num_heads % kv):
        p.append(f"model.num_kv_heads ({kv}) must be >= 1 and divide model.num_heads ({m.num_heads})")
    if m.max_position_embeddings and m.seq_len > m.max_position_embeddings:
        p.append(f"model.seq_len ({m.seq_len}) exceeds the model's max_position_embeddings "
                 f"({m.max_position_embeddings}); lower model.seq_len, or extend the context: set "
                 f"model.max_position_embeddings to at least {m.seq_len}, with model.rope_scaling (e.g. "
                 f"{{rope_type: yarn, factor: {-(-m.seq_len // m.max_position_embeddings)}}}) if RoPE should stretch "
                 "(docs/MODELS.md)")
    p += family_problems(m) + image_path_problems(cfg)
    if m.ffn_hidden_size is not None and m.ffn_hidden_size < 1:
        p.append(f"model.ffn_hidden_size: must be >= 1, got {m.ffn_hidden_size}")
    if cfg.data.tokenizer == "bytes" and m.vocab_size < 256:
        p.append(f"model.vocab_size ({m.vocab_size}) must be >= 256 with data.tokenizer: bytes")
    return p


def image_path_problems(cfg: JobConfig) -> list[str]:
    """A vision-language model's layouts: the images reach the input stage whole."""
    m = cfg.model
    if m.image_path is None:
        return []
    return [f"parallel.{k}: {getattr(cfg.parallel, k)} with the image path of {m.image_path.architecture} is not "
            f"built yet (the images would have to reach one pipeline stage, or one context-parallel chunk); set "
            f"parallel.{k}: 1, or leave it auto" for k in ("pp", "cp")
            if isinstance(getattr(cfg.parallel, k), int) and getattr(cfg.parallel, k) > 1]


def family_problems(m: Any) -> list[str]:
    """The architecture, and what the model section says against what its family reads: head width, attention,
    RoPE scaling."""
    p: list[str] = []
    family = families.find(m.architecture)
    if family is None:
        p.append(f"model.architecture: {m.architecture!r} is not supported; supported: "
                 f"{', '.join(families.names())}")
    if m.head_dim is not None:
        p += head_dim_problems(m, family or families.DEFAULT)
    p += attention_problems(m, family or families.DEFAULT)
    if m.rope_scaling:
        kind = str(m.rope_scaling.get("rope_type", m.rope_scaling.get("type", "default")))
        rope_types = (family or families.DEFAULT).keys.rope_types
        if kind not in rope_types:
            p.append(f"model.rope_scaling: rope type {kind!r} is not supported; supported: {', '.join(rope_types)}")
        p += extended_rope_problems(m, kind)
    own = (family or families.DEFAULT).keys.own
    p += [f"model.family_keys: {key!r} is not a key {m.architecture} reads; "
          + (f"its own keys: {', '.join(own)}" if own else "it has none: drop model.family_keys")
          for key in (m.family_keys or {}) if key not in own]
    return p


# Keys whose value must be a finite number in a range; (key, lowest, inclusive, highest, inclusive, why).
_NUMBER_RULES = (
    ("train.weight_decay", 0.0, True, None, True, "AdamW weight decay"),
    ("train.adam_beta1", 0.0, True, 1.0, False, "AdamW beta1, in [0, 1)"),
    ("train.adam_beta2", 0.0, True, 1.0, False, "AdamW beta2, in [0, 1)"),
    ("train.grad_clip", 0.0, True, None, True, "0 disables clipping"),
    ("train.eval_every_steps", 0, True, None, True, "0: only at the end"),
    ("train.seed", 0, True, 2**32 - 1, True, "numpy and torch seeds are unsigned 32-bit"),
    ("model.init_std", 0.0, False, None, True, "the standard deviation of random weights"),
    ("model.rope_theta", 0.0, False, None, True, "RoPE's base"),
    ("model.norm_eps", 0.0, False, None, True, "RMSNorm's epsilon; 0 divides by zero on a zero row"),
    ("tracking.charts_every_checkpoints", 0, True, None, True, "0: only at the end"),
    ("resilience.elastic_monitor_interval_s", 0.0, False, None, True, "how often Ray checks for capacity"),
)


def number_problems(cfg: JobConfig) -> list[str]:
    """Numbers: finite, and in their range (a negative grad_clip used to switch clipping off silently)."""
    p = []
    for key in ("train.lr", "train.min_lr"):
        v = getattr(cfg.train, key.split(".")[1])
        if isinstance(v, float) and not math.isfinite(v):
            p.append(f"{key}: must be a finite number (or auto), got {v}")
    for key, lo, lo_in, hi, hi_in, why in _NUMBER_RULES:
        v = _get(cfg, key)
        if isinstance(v, float) and not math.isfinite(v):
            p.append(f"{key}: must be a finite number, got {v} ({why})")
            continue
        if (lo is not None and (v < lo or (v == lo and not lo_in))) or (
                hi is not None and (v > hi or (v == hi and not hi_in))):
            lo_s = "" if lo is None else f"{'>=' if lo_in else '>'} {lo:g}"
            hi_s = "" if hi is None else f"{'<=' if hi_in else '<'} {hi:g}"
            p.append(f"{key}: must be {' and '.join(x for x in (lo_s, hi_s) if x)}, got {v} ({why})")
    return p


def _get(cfg: JobConfig, dotted: str) -> float:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _val_fraction_problems(cfg: JobConfig) -> list[str]:
    """Held out from the training data, less than half of it; a GRPO job may train on every prompt (0: no
    val/reward)."""
    d = cfg.data
    if d.val_split is not None or 0.0 < d.val_fraction < 0.5 or (cfg.train.objective == "grpo" and not d.val_fraction):
        return []
    return [f"data.val_fraction: must be in (0, 0.5), got {d.val_fraction}"]


def data_problems(cfg: JobConfig) -> list[str]:
    """The data section: each source with the keys it needs, the chat format with a tokenizer that has a template."""
    d, p = cfg.data, []
    paths = [d.path] if isinstance(d.path, str) else list(d.path or [])
    if d.source in ("files", "tokens") and not paths:
        kinds = ("text, JSONL or Parquet files, a save_to_disk folder or a .bin" if d.source == "files"
                 else ".rstok token shards")
        p.append(f"data.path: required with data.source: {d.source} (paths or globs of {kinds})")
    if d.source in ("python-stdlib", "hf") and paths:
        p.append(f"data.path is set but data.source is {d.source}: set data.source: files (or tokens) to use it")
    if d.source == "hf" and not d.dataset:
        p.append("data.dataset: required with data.source: hf (a hub name such as org/name, or a local dataset folder)")
    if d.source != "hf" and (d.dataset or d.streaming):
        p.append(f"data.{'dataset' if d.dataset else 'streaming'} is set but data.source is {d.source}: it is read "
                 "only with data.source: hf")
    if not d.text_field:
        p.append("data.text_field: must name a field of the records (default text)")
    if d.format == "chat" and d.source == "python-stdlib":
        p.append("data.format: chat needs records with messages; use data.source: files (JSONL/Parquet) or hf")
    if d.format == "chat" and d.tokenizer == "bytes":
        p.append("data.format: chat needs a tokenizer with a chat template; set data.tokenizer: model (the tokenizer "
                 "of model.pretrained) or the path of a transformers tokenizer directory")
    if d.tokenizer == "model" and not cfg.model.pretrained:
        p.append("data.tokenizer: model means the tokenizer of model.pretrained, which is not set; set "
                 "model.pretrained or give the tokenizer's path")
    if d.val_split is not None and d.source not in ("hf", "files"):
        p.append(f"data.val_split: data.source {d.source} has no splits; leave it null (val_fraction is used)")
    if d.val_split is not None and d.val_split == d.split:
        p.append(f"data.val_split: {d.val_split!r} is also data.split; validation must be held out")
    if d.document_masking and any(x.endswith(".bin") for x in paths):
        p.append("data.document_masking: raw .bin token files record no document boundaries; write token shards "
                 "(data.source: tokens) or tokenize text")
    return p + _val_fraction_problems(cfg)



def capacity_problems(cfg: JobConfig, cluster_resources: dict[str, float]) -> list[str]:
    """What stops the cluster (its total resources) from ever holding the job's minimum number of workers."""
    c = cfg.cluster
    per_worker = {"CPU": c.cpus_per_worker, **c.resources_per_worker}
    if c.use_gpu:
        per_worker["GPU"] = 1.0
    problems = []
    for res, amount in per_worker.items():
        have = float(cluster_resources.get(res, 0.0))
        need = amount * c.min_workers
        if res == "GPU" and have == 0:
            problems.append("cluster.use_gpu: true, but the Ray cluster has no GPU in all; set cluster.use_gpu: false "
                            "to train on CPU, or add GPU nodes to the cluster")
        elif need > have + 1e-9:
            problems.append(
                f"cluster.num_workers ({c.num_workers}): {c.min_workers} workers x {amount:g} {res} = {need:g} {res}, "
                f"but the Ray cluster has {have:g} {res} in all; lower cluster.num_workers or "
                f"cluster.{'cpus_per_worker' if res == 'CPU' else 'resources_per_worker'}, or add nodes"
            )
    return problems


def health_problems(cfg: JobConfig, lint_cluster_env: bool = True) -> list[str]:
    """The health section and the linted cluster.env (an error-level lint issue stops the job)."""
    h, out = cfg.health, []
    if not h.grad_norm_spike_factor > 1:
        out.append(f"health.grad_norm_spike_factor: {h.grad_norm_spike_factor} must be > 1 (a spike is a multiple of "
                   "the recent median; 10 is the default)")
    if h.watchdog_window < 1:
        out.append(f"health.watchdog_window: {h.watchdog_window} must be >= 1")
    if h.watchdog_max_skips < 0:
        out.append(f"health.watchdog_max_skips: {h.watchdog_max_skips} must be >= 0 (0: never escalate to a rollback)")
    if not 0 < h.slow_rank_factor <= 1:
        out.append(f"health.slow_rank_factor: {h.slow_rank_factor} must be in (0, 1] (0.5: half the others' median)")
    if h.preflight_min_busbw_gbps < 0:
        out.append(f"health.preflight_min_busbw_gbps: {h.preflight_min_busbw_gbps} must be >= 0")
    env = (cfg.cluster.env or {}) if lint_cluster_env else {}
    for issue in lint_env(env, production=h.production, world_size=cfg.cluster.max_workers):
        if issue.severity == "error":
            out.append(f"cluster.env.{issue.variable}: {issue.cause}; {issue.remedy}")
    return out
