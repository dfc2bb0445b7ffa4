"""YAML job file -> JobConfig, with every problem reported together, each naming its dotted key."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import os
import re
import types
import typing
from typing import Any, Literal, Union

import yaml

from rayspeed.config.schema import AUTO, JobConfig
from rayspeed.errors import ConfigError

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


# ---------------------------------------------------------------- docs


@functools.lru_cache(maxsize=None)
def _field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass (torchtitan-style field docstrings)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def field_doc(cls: type, name: str) -> str:
    return _field_docs(cls).get(name, "")


def describe_keys(cls: type = JobConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, type, doc) for every leaf key: the reference printed by `rayspeed keys`."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = prefix + f.name
        if dataclasses.is_dataclass(tp):
            out += describe_keys(tp, key + ".")
        else:
            out.append((key, _type_name(tp), field_doc(cls, f.name)))
    return out


# ---------------------------------------------------------------- typing


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        k, v = typing.get_args(tp)
        return f"mapping {_type_name(k)} -> {_type_name(v)}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping {" + ", ".join(f.name for f in dataclasses.fields(tp)) + "}"
    return getattr(tp, "__name__", str(tp))


class _Bad(Exception):
    pass


def _coerce(tp: Any, value: Any, key: str, problems: list[str]) -> Any:
    """Value checked against the annotation; raises _Bad when it does not match."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(arg, value, key, problems)
            except _Bad:
                continue
        raise _Bad
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) is type(typing.get_args(tp)[0]):
            return value
        raise _Bad
    if tp is type(None):
        if value is None:
            return None
        raise _Bad
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads 1e-4 (no dot) as a string; a number is what was meant.
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            return float(value)
        raise _Bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Bad
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise _Bad
        return [_coerce(item, v, key, problems) for v in value]
    if origin is dict:
        kt, vt = typing.get_args(tp)
        if not isinstance(value, dict):
            raise _Bad
        return {_coerce(kt, k, key, problems): _coerce(vt, v, key, problems) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Bad
        return _build(tp, value, key + ".", problems)
    raise TypeError(f"unsupported annotation {tp!r} at {key}")


def _build(cls: type, data: dict, prefix: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        key = prefix + str(k)
        if k not in names:
            close = difflib.get_close_matches(str(k), names, n=1)
            hint = f"did you mean '{prefix}{close[0]}'?" if close else f"allowed keys here: {', '.join(names)}"
            problems.append(f"{key}: unknown key; {hint}")
            continue
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            if v is None:
                continue
            if not isinstance(v, dict):
                problems.append(f"{key}: expected a mapping with keys {', '.join(f.name for f in dataclasses.fields(tp))}, got {v!r}")
                continue
            kwargs[k] = _build(tp, v, key + ".", problems)
            continue
        try:
            kwargs[k] = _coerce(tp, v, key, problems)
        except _Bad:
            problems.append(f"{key}: expected {_type_name(tp)}, got {v!r} ({type(v).__name__})")
    return cls(**kwargs)


# ---------------------------------------------------------------- overrides


def _apply_override(data: dict, assignment: str, problems: list[str]) -> None:
    if "=" not in assignment:
        problems.append(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set train.max_steps=100")
        return
    key, raw = assignment.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else None
    except yaml.YAMLError as e:
        problems.append(f"--set {key}: the value {raw!r} is not valid YAML ({str(e).splitlines()[0]})")
        return
    parts = key.split(".")
    node = data
    cls: Any = JobConfig
    for i, part in enumerate(parts):
        names = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if part not in names:
            close = difflib.get_close_matches(part, list(names), n=1)
            where = ".".join(parts[:i]) or "the top level"
            hint = f"did you mean '{'.'.join(parts[:i] + [close[0]])}'?" if close else f"keys under {where}: {', '.join(names)}"
            problems.append(f"--set {key}: unknown key; {hint}")
            return
        hint_t = typing.get_type_hints(cls)[part]
        if i == len(parts) - 1:
            node[part] = value
            return
        if not dataclasses.is_dataclass(_strip_optional(hint_t)):
            problems.append(f"--set {key}: '{'.'.join(parts[: i + 1])}' is a value, not a section")
            return
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
        cls = _strip_optional(hint_t)


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


# ---------------------------------------------------------------- cross-field checks


def check(cfg: JobConfig) -> list[str]:
    """Static cross-field checks (those that need no cluster). All problems, not the first."""
    p: list[str] = []
    m, t, par, c, r = cfg.model, cfg.train, cfg.parallel, cfg.cluster, cfg.resilience
    if not _NAME_RE.match(cfg.name):
        p.append(f"name: {cfg.name!r} must be letters, digits, '.', '_' or '-' (it names folders and runs)")
    for key in ("hidden_size", "num_layers", "num_heads", "vocab_size", "seq_len"):
        if getattr(m, key) < 1:
            p.append(f"model.{key}: must be >= 1, got {getattr(m, key)}")
    if m.num_heads >= 1 and m.hidden_size % m.num_heads:
        p.append(f"model.hidden_size ({m.hidden_size}) must be divisible by model.num_heads ({m.num_heads})")
    elif m.num_heads >= 1 and (m.hidden_size // m.num_heads) % 2:
        p.append(f"model: head dim hidden_size/num_heads = {m.hidden_size // m.num_heads} must be even for RoPE")
    if m.kv_heads < 1 or (m.num_heads >= 1 and m.num_heads % m.kv_heads):
        p.append(f"model.num_kv_heads ({m.kv_heads}) must be >= 1 and divide model.num_heads ({m.num_heads})")
    if m.ffn_hidden_size is not None and m.ffn_hidden_size < 1:
        p.append(f"model.ffn_hidden_size: must be >= 1, got {m.ffn_hidden_size}")
    if cfg.data.tokenizer == "bytes" and m.vocab_size < 256:
        p.append(f"model.vocab_size ({m.vocab_size}) must be >= 256 with data.tokenizer: bytes")
    if cfg.data.source == "files" and not cfg.data.path:
        p.append("data.path: required with data.source: files (a glob of text files or a .bin token file)")
    if cfg.data.source == "python-stdlib" and cfg.data.path:
        p.append("data.path is set but data.source is python-stdlib: set data.source: files to use it")
    if not 0.0 < cfg.data.val_fraction < 0.5:
        p.append(f"data.val_fraction: must be in (0, 0.5), got {cfg.data.val_fraction}")
    if t.global_batch_size < 1:
        p.append(f"train.global_batch_size: must be >= 1, got {t.global_batch_size}")
    if t.max_steps < 1:
        p.append(f"train.max_steps: must be >= 1, got {t.max_steps}")
    if t.lr != AUTO and t.lr <= 0:
        p.append(f"train.lr: must be > 0 (or auto), got {t.lr}")
    if t.lr != AUTO and t.min_lr > t.lr:
        p.append(f"train.min_lr ({t.min_lr}) must not exceed train.lr ({t.lr})")
    if t.warmup_steps < 0:
        p.append(f"train.warmup_steps: must be >= 0, got {t.warmup_steps}")
    if t.eval_batches < 1:
        p.append(f"train.eval_batches: must be >= 1, got {t.eval_batches}")
    for key in ("dp", "tp", "pp", "micro_batch_size", "grad_accum"):
        v = getattr(par, key)
        if v != AUTO and v < 1:
            p.append(f"parallel.{key}: must be >= 1 or auto, got {v}")
    if par.zero_stage != AUTO and par.zero_stage not in (0, 1, 2, 3):
        p.append(f"parallel.zero_stage: must be 0, 1, 2, 3 or auto, got {par.zero_stage}")
    if par.tp != AUTO and par.tp >= 1:
        if m.num_heads % par.tp or m.kv_heads % par.tp:
            p.append(
                f"parallel.tp ({par.tp}) must divide model.num_heads ({m.num_heads}) and "
                f"model.num_kv_heads ({m.kv_heads})"
            )
        if m.vocab_size % par.tp:
            p.append(f"parallel.tp ({par.tp}) must divide model.vocab_size ({m.vocab_size}) (vocab-parallel embedding)")
        if c.use_gpu and par.tp > c.gpus_per_node:
            p.append(f"parallel.tp ({par.tp}) must not exceed cluster.gpus_per_node ({c.gpus_per_node}): tp never spans nodes")
    if par.pp != AUTO and par.pp >= 1 and par.pp > m.num_layers:
        p.append(f"parallel.pp ({par.pp}) must not exceed model.num_layers ({m.num_layers})")
    if par.pp not in (AUTO, 1) and par.zero_stage not in (AUTO, 0, 1):
        p.append(
            f"parallel.zero_stage ({par.zero_stage}) with parallel.pp ({par.pp}): DeepSpeed's pipeline engine "
            "supports ZeRO 0 or 1 only; set parallel.zero_stage to 0, 1 or auto"
        )
    if par.sequence_parallel is True and par.tp == 1:
        p.append("parallel.sequence_parallel: true needs parallel.tp > 1 (or leave it auto)")
    if isinstance(c.num_workers, list):
        if len(c.num_workers) != 2 or c.num_workers[0] < 1 or c.num_workers[0] > c.num_workers[1]:
            p.append(f"cluster.num_workers: expected an int or [min, max] with 1 <= min <= max, got {c.num_workers}")
    elif c.num_workers < 1:
        p.append(f"cluster.num_workers: must be >= 1, got {c.num_workers}")
    if c.cpus_per_worker <= 0:
        p.append(f"cluster.cpus_per_worker: must be > 0, got {c.cpus_per_worker}")
    if c.gpus_per_node < 1 or c.num_nodes < 1:
        p.append("cluster.gpus_per_node and cluster.num_nodes: must be >= 1")
    if c.local_num_cpus != AUTO and c.local_num_cpus < 1:
        p.append(f"cluster.local_num_cpus: must be >= 1 or auto, got {c.local_num_cpus}")
    if r.keep_checkpoints < 2:
        p.append(f"resilience.keep_checkpoints: never fewer than 2 (got {r.keep_checkpoints}): a newer checkpoint must verify before an older one goes")
    if r.max_failures < 0:
        p.append(f"resilience.max_failures: must be >= 0, got {r.max_failures}")
    if r.checkpoint_every_steps < 0:
        p.append(f"resilience.checkpoint_every_steps: must be >= 0, got {r.checkpoint_every_steps}")
    if r.collective_timeout_s <= 0:
        p.append(f"resilience.collective_timeout_s: must be > 0, got {r.collective_timeout_s}")
    if cfg.tracking.log_every_steps < 1:
        p.append(f"tracking.log_every_steps: must be >= 1, got {cfg.tracking.log_every_steps}")
    if cfg.storage.path != AUTO and "://" not in cfg.storage.path and not os.path.isabs(os.path.expanduser(cfg.storage.path)):
        p.append(f"storage.path: must be absolute (all nodes must see it), got {cfg.storage.path!r}")
    if cfg.storage.path != AUTO and "://" in cfg.storage.path and not cfg.storage.path.startswith("file://"):
        scheme = cfg.storage.path.split("://", 1)[0]
        if not _known_scheme(scheme):
            p.append(f"storage.path: {cfg.storage.path!r} has a scheme ({scheme}://) no filesystem handles; use an "
                     "absolute local path or an object-store URI such as s3://bucket/prefix or gs://bucket/prefix")
    if cfg.storage.staging_dir != AUTO and not os.path.isabs(os.path.expanduser(cfg.storage.staging_dir)):
        p.append(f"storage.staging_dir: must be an absolute node-local path, got {cfg.storage.staging_dir!r}")
    for key in ("kill_rank_at_step", "kill_rank_in_checkpoint", "hang_rank_at_step"):
        k = getattr(cfg.chaos, key)
        if k is not None and (k.rank < 0 or k.step < 1):
            p.append(f"chaos.{key}: rank must be >= 0 and step >= 1, got {{rank: {k.rank}, step: {k.step}}}")
        elif k is not None and k.rank >= c.max_workers:
            p.append(f"chaos.{key}: rank {k.rank} does not exist with cluster.num_workers {c.num_workers}")
    return p


def _known_scheme(scheme: str) -> bool:
    """Whether pyarrow resolves URIs of this scheme (asked with a dummy URI; an unknown scheme fails at once,
    before any network access, while a known one may fail later for other reasons)."""
    if scheme in ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "mock", "file"):
        return True
    try:
        from pyarrow import fs as pafs

        pafs.FileSystem.from_uri(f"{scheme}://rayspeed-scheme-probe/x")
    except Exception as e:
        return "Unrecognized filesystem type" not in str(e)
    return True


# ---------------------------------------------------------------- entry points


def parse(data: Any, overrides: list[str] | None = None, source: str = "<dict>") -> JobConfig:
    """A mapping (from YAML) plus --set overrides -> checked JobConfig. Raises ConfigError with all problems."""
    problems: list[str] = []
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections (name, model, train, ...)")
    data = _deep_copy(data)
    for o in overrides or []:
        _apply_override(data, o, problems)
    cfg = _build(JobConfig, data, "", problems)
    if not problems:
        problems += check(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def load(path: str, overrides: list[str] | None = None) -> JobConfig:
    if not os.path.exists(path):
        raise ConfigError(f"--config {path}: no such file (see configs/ for examples)")
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: YAML syntax error{where}: {problem}") from None
    return parse(data, overrides, source=path)


def _deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> dotted keys (MLflow params)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def replace(cfg: Any, **sections: Any) -> Any:
    return dataclasses.replace(cfg, **sections)
