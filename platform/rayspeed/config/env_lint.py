"""The environment-variable lint: invented, deprecated and debug-only communication variables, from the table in
env_vars.yaml (package data). A job's `cluster.env` is linted with every other key before anything starts; the
health package turns the same issues into doctor findings (`rayspeed doctor --env`)."""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Mapping, Optional

import yaml

ENV_STATUSES = ("invented", "deprecated", "debug", "tuning", "known")
DEFAULT_SOURCE = "NCCL user guide; PyTorch ProcessGroupNCCL"


@dataclass(frozen=True)
class EnvTable:
    env: dict[str, dict[str, Any]]
    """Variable -> {status, use, why, source, bad (upper-cased values), ...}."""
    alloc_conf_keys: frozenset[str]
    """Keys PYTORCH_CUDA_ALLOC_CONF accepts."""
    lint_prefixes: tuple[str, ...]
    """Prefixes of the variables the lint looks at in a whole environment."""

    def relevant(self, name: str) -> bool:
        return name in self.env or any(name.startswith(p) for p in self.lint_prefixes)


@dataclass
class EnvIssue:
    variable: str
    value: str
    severity: str
    """error | warn | info."""
    cause: str
    use: str
    """What to use instead ("" when it should simply go)."""
    status: str
    source: str = DEFAULT_SOURCE
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def remedy(self) -> str:
        if not self.use:
            return "remove it"
        if self.use.startswith("nothing"):  # "nothing (removed)": no replacement
            return f"remove it {self.use[len('nothing'):].strip()}".strip()
        if self.use[0].islower():  # an instruction of its own: "unset it", "leave unset", "leave it on (1)"
            return self.use
        return f"use {self.use}"


def parse_table(raw: Mapping[str, Any]) -> EnvTable:
    """Check and build the table from a parsed YAML mapping; a malformed entry is a bug in the file (ValueError)."""
    env = {}
    for name, r in (raw.get("env") or {}).items():
        r = dict(r or {})
        if r.get("status") not in ENV_STATUSES:
            raise ValueError(f"env_vars.yaml {name}: unknown status {r.get('status')!r}")
        if r["status"] in ("invented", "deprecated") and not r.get("use"):
            raise ValueError(f"env_vars.yaml {name}: an {r['status']} variable needs `use` (its replacement)")
        r["bad"] = [str(v).upper() for v in r.get("bad") or []]
        env[name] = r
    return EnvTable(env=env, alloc_conf_keys=frozenset(raw.get("alloc_conf_keys") or ()),
                    lint_prefixes=tuple(raw.get("lint_prefixes") or ()))


@functools.lru_cache(maxsize=1)
def table() -> EnvTable:
    text = resources.files("rayspeed.config").joinpath("env_vars.yaml").read_text(encoding="utf-8")
    # The C loader when PyYAML has it: the pure-Python one is several times slower on this file.
    return parse_table(yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {})


def _alloc_conf(name: str, value: str, t: EnvTable) -> list[EnvIssue]:
    out = []
    for item in filter(None, (s.strip() for s in value.split(","))):
        key = item.split(":", 1)[0].strip()
        if key not in t.alloc_conf_keys:
            close = difflib.get_close_matches(key, sorted(t.alloc_conf_keys), n=1)
            use = close[0] if close else "one of " + ", ".join(sorted(t.alloc_conf_keys))
            out.append(EnvIssue(name, value, "error", f"{name}: '{key}' is not an allocator option (PyTorch refuses "
                                "to start with it)", use, "invented",
                                "PyTorch CUDA semantics (PYTORCH_CUDA_ALLOC_CONF)"))
    return out


def lint_env(env: Mapping[str, str], production: bool = True, world_size: Optional[int] = None) -> list[EnvIssue]:
    """Issues with the communication-related variables in `env` (other variables are ignored).

    error: the variable does not exist, is deprecated, or (production) is a debug-only knob with a harmful value;
    warn: an undocumented NCCL_/TORCH_NCCL_ name (NCCL ignores unknown names silently: usually a typo), or a
    harmful value outside production; info: debug knobs outside production.
    """
    t = table()
    out: list[EnvIssue] = []
    for name in sorted(env):
        if not t.relevant(name):
            continue
        value = str(env[name])
        if name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            out += _alloc_conf(name, value, t)
            continue
        r = t.env.get(name)
        if r is None:
            close = difflib.get_close_matches(name, [k for k, e in t.env.items() if e["status"] != "invented"], n=1,
                                              cutoff=0.75)
            out.append(EnvIssue(name, value, "warn", f"{name} is not a variable NCCL or PyTorch documents; unknown "
                                "names are ignored silently, so this is usually a typo", close[0] if close else "",
                                "unknown", "NCCL user guide (environment variables)"))
            continue
        status, use, why = r["status"], str(r.get("use") or ""), str(r.get("why") or "")
        src = str(r.get("source") or "") or DEFAULT_SOURCE
        bad_value = value_problem(value, r)
        if bad_value and status not in ("invented", "deprecated"):
            out.append(EnvIssue(name, value, "error", f"{name}={value}: {bad_value}",
                                "fix the value, or unset it (NCCL's default)", "invalid", src))
            continue
        if status == "invented":
            out.append(EnvIssue(name, value, "error", f"{name} does not exist: {why}", use, status, src))
        elif status == "deprecated":
            out.append(EnvIssue(name, value, "error", f"{name} is deprecated: {why}", use, status, src))
        elif status == "debug":
            if r["bad"] and value.strip().upper() not in r["bad"]:
                continue
            where = "a debug-only knob in production" if production else "a debug-only knob (fine while debugging)"
            out.append(EnvIssue(name, value, "error" if production else "info", f"{name}={value} is {where}: {why}",
                                use, status, src))
        elif status == "known" and r["bad"] and value.strip().upper() in r["bad"]:
            above = r.get("required_above_gpus")
            sev = "error" if (above and world_size and world_size > int(above)) else "warn"
            out.append(EnvIssue(name, value, sev, f"{name}={value}: {why}", use, status, src))
    return out


def value_problem(value: str, r: Mapping[str, Any]) -> Optional[str]:
    """Why `value` is not one the variable accepts (its table entry's choices / int range), else None."""
    v = value.strip()
    if not v:  # NCCL reads an empty value as unset
        return None
    choices = [str(c) for c in r.get("choices") or []]
    if choices:
        allowed = {c.upper(): c for c in choices}
        items = [v]
        if r.get("list"):  # "Ring,Tree", "^LL128", or per collective: "allreduce:tree;allgather:ring" (NCCL 2.24+)
            items = [x.strip() for part in v.split(";") for x in part.split(":")[-1].lstrip("^").split(",")]
        wrong = [x for x in items if x.upper() not in allowed]
        if wrong or not v:
            close = difflib.get_close_matches((wrong or [v])[0].upper(), list(allowed), n=1, cutoff=0.6)
            hint = f"; did you mean {allowed[close[0]]}?" if close else ""
            kind = "a comma-separated list of " if r.get("list") else "one of "
            return f"not a value it accepts ({kind}{', '.join(choices)}){hint}"
    bounds = r.get("int")
    if bounds:
        lo, hi = bounds
        try:
            n = int(v)
        except ValueError:
            return "must be an integer"
        if (lo is not None and n < lo) or (hi is not None and n > hi):
            return f"must be an integer {'>= ' + str(lo) if lo is not None else ''}" + (
                f"{' and ' if lo is not None else ''}<= {hi}" if hi is not None else "")
    return None


def relevant_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of an environment the lint looks at."""
    t = table()
    return {k: str(v) for k, v in environ.items() if t.relevant(k)}
