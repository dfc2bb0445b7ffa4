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

from rayspeed.config.schema import JobConfig
from rayspeed.config.validate import check
from rayspeed.errors import ConfigError
from rayspeed.redact import redact_mapping, redact_value

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
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
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
        if value is False and "off" in typing.get_args(tp):  # YAML 1.1 reads a bare `off` as false
            return "off"
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
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
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
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if v is None:
                continue
            if not isinstance(v, dict):
                keys = ", ".join(f.name for f in dataclasses.fields(tp))
                problems.append(f"{key}: expected a mapping with keys {keys}, got {redact_value(k, v)!r}")
                continue
            kwargs[k] = _build(tp, v, key + ".", problems)
            continue
        try:
            kwargs[k] = _coerce(tp, v, key, problems)
        except _Bad:
            # The value is quoted back masked: under a secret key (or holding one) it is a credential.
            problems.append(f"{key}: expected {_type_name(tp)}, got {redact_value(k, v)!r} ({type(v).__name__})")
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
            hint = (f"did you mean '{'.'.join(parts[:i] + [close[0]])}'?" if close
                    else f"keys under {where}: {', '.join(names)}")
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


# ---------------------------------------------------------------- entry points


def parse(data: Any, overrides: list[str] | None = None, source: str = "<dict>",
          lint_cluster_env: bool = True, written: bool = False) -> JobConfig:
    """A mapping (from YAML) plus --set overrides -> checked JobConfig. Raises ConfigError with all problems.
    `written`: the mapping is what a person wrote (a job file, load()), not a complete job another process
    serialized; only then does a key given at its default value mean something (model.init: pretrained)."""
    problems: list[str] = []
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections (name, model, train, ...)")
    data = _deep_copy(data)
    for o in overrides or []:
        _apply_override(data, o, problems)
    _anchor_relative_paths(data)
    cfg = _build(JobConfig, data, "", problems)
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    # A dumped config (config/resolved.yaml, a dry run's output) always carries `pretrained: null` beside the
    # default `init: pretrained`: only an init given without any pretrained key is the mistake.
    if written and not problems and model.get("init") == "pretrained" and "pretrained" not in model:
        problems.append("model.init: pretrained needs model.pretrained (a Hugging Face model directory or hub id); "
                        "set it, or set model.init: random to train the shape given here from scratch")
    if not problems and cfg.model.pretrained:
        from rayspeed.config.hf_config import pretrained_problems

        explicit = data.get("model") if isinstance(data.get("model"), dict) else {}
        problems += pretrained_problems(cfg, set(explicit))
    if not problems:
        problems += check(cfg, lint_cluster_env)
    if problems:
        raise ConfigError(problems)
    return cfg


# Inputs a job file may name with ./ or ../: anchored once, here, so the driver, every worker and the records
# (config/resolved.yaml) see one absolute path, whatever directory each process runs in.
_RELATIVE_INPUTS = (("model", "pretrained"), ("data", "path"), ("data", "tokenizer"), ("train", "init_from"),
                    ("eval", "harness", "include_path"), ("eval", "harness", "tasks"))


def relative_base() -> str:
    """What ./ and ../ in a job file are relative to: the launch home ($RAYSPEED_HOME, which `make` and `make
    submit` set to the repository; `ray job submit --working-dir` runs the driver from a temporary copy), else the
    current directory."""
    return os.environ.get("RAYSPEED_HOME") or os.getcwd()


def _anchor(value: Any) -> Any:
    if isinstance(value, str) and value.startswith(("./", "../")):
        return os.path.normpath(os.path.join(relative_base(), value))
    if isinstance(value, list):
        return [_anchor(v) for v in value]
    return value


def _anchor_relative_paths(data: dict) -> None:
    for *sections, key in _RELATIVE_INPUTS:
        sec: Any = data
        for name in sections:
            sec = sec.get(name) if isinstance(sec, dict) else None
        if isinstance(sec, dict) and key in sec:
            sec[key] = _anchor(sec[key])


def load(path: str, overrides: list[str] | None = None, lint_cluster_env: bool = True) -> JobConfig:
    if not os.path.exists(path):
        raise ConfigError(f"--config {path}: no such file (see configs/ for examples)")
    if os.path.isdir(path):
        raise ConfigError(f"--config {path}: is a directory; give the job's YAML file (e.g. {path.rstrip('/')}/"
                          "tiny-cpu.yaml)")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path}: not UTF-8 text (byte {e.start}: {e.reason}); give the job's YAML file, "
                          "saved as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror}); "
                          "check the path and its permissions") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: YAML syntax error{where}: {problem}") from None
    if data is None:  # an empty or comment-only file is a mistake, not a request for the default job
        raise ConfigError(f"--config {path}: the job file is empty (or only comments); give at least a name and the "
                          "sections to change, e.g. configs/tiny-cpu.yaml")
    return parse(data, overrides, source=path, lint_cluster_env=lint_cluster_env, written=True)


def _deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any) -> str:
    """The config as YAML for people and records (--dry-run, MLflow's config/resolved.yaml): secrets masked
    (rayspeed.redact). Not for handing the config on: use to_dict."""
    return yaml.safe_dump(redact_mapping(to_dict(cfg)), sort_keys=False)


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
