"""Environment profiles by cluster size, and the lint that rejects variables nothing reads.

env_profile(cfg, world_size) -> {name: value}     what the workers' runtime environment gets
profile(cfg, world_size) -> dict                  the same with the tier, the notes and where each value came from
lint_env(env, production=True, world_size=None)   Findings for invented, deprecated and debug-only variables

The profile is the planner's communication rule (PLAYBOOK B.2, rayspeed.planner.rules.comm_profile) for this
job's size and hardware, with the job's own `cluster.env` on top (the user's value wins, and is linted).
"""

from __future__ import annotations

import difflib
import logging
from typing import Any, Mapping

from rayspeed.health.knowledge import Finding, load

log = logging.getLogger("rayspeed.health")

_LAYOUT_INTS = ("dp", "tp", "pp", "zero_stage", "micro_batch_size", "grad_accum")


def _layout(cfg, world: int):
    """The job's layout when it is resolved, else the planner's choice, else plain data parallel (the profile's
    variables depend on the world size and hardware only; the layout shapes the notes)."""
    from rayspeed.config.layout import Layout

    p = cfg.parallel
    if all(isinstance(getattr(p, k), int) and not isinstance(getattr(p, k), bool) for k in _LAYOUT_INTS):
        sp = p.sequence_parallel if isinstance(p.sequence_parallel, bool) else False
        ac = p.activation_checkpointing if p.activation_checkpointing != "auto" else "none"
        return Layout(p.dp, p.tp, p.pp, p.zero_stage, p.micro_batch_size, p.grad_accum, sp, ac)
    from rayspeed.errors import ConfigError
    from rayspeed.planner import plan_job

    try:
        return plan_job(cfg, world).layout
    except ConfigError:
        return Layout(world, 1, 1, 0, 1, 1, False, "none")


def profile(cfg, world_size: int | None = None) -> dict[str, Any]:
    """The communication profile for `world_size` workers of this job: tier, backend, env, notes, and which
    variables came from the rule and which from cluster.env."""
    from rayspeed.planner.rules import comm_profile
    from rayspeed.planner.search import build_ctx

    world = int(world_size or cfg.cluster.max_workers)
    ctx = build_ctx(cfg, world)
    rule = comm_profile(ctx, _layout(cfg, world), cfg.resilience.collective_timeout_s)
    env = {k: str(v) for k, v in rule["env"].items()}
    user = {str(k): str(v) for k, v in (getattr(cfg.cluster, "env", None) or {}).items()}
    overridden = sorted(k for k in user if k in env and env[k] != user[k])
    env.update(user)
    return {"world_size": world, "tier": rule["tier"], "backend": rule["backend"], "env": env,
            "from_rule": {k: str(v) for k, v in rule["env"].items()}, "from_cluster_env": user,
            "overridden": overridden, "notes": list(rule["notes"]), "deepspeed": dict(rule["deepspeed"])}


def env_profile(cfg, world_size: int | None = None) -> dict[str, str]:
    """Variables for the workers' runtime environment: the communication rule's plus cluster.env."""
    return profile(cfg, world_size)["env"]


def describe(prof: Mapping[str, Any]) -> str:
    """One log line: the tier and every variable with where it came from."""
    parts = [f"{k}={v}" + (" (cluster.env)" if k in prof["from_cluster_env"] else "")
             for k, v in sorted(prof["env"].items())]
    over = f"; cluster.env overrides the rule for {', '.join(prof['overridden'])}" if prof["overridden"] else ""
    return (f"env profile for {prof['world_size']} workers, {prof['tier']}: "
            + (", ".join(parts) if parts else "no variables") + over)


def log_profile(cfg, world_size: int | None = None) -> dict[str, str]:
    """env_profile, logged as one line (what the launcher applies to the workers)."""
    prof = profile(cfg, world_size)
    log.info("%s", describe(prof))
    return prof["env"]


# ---------------------------------------------------------------- lint


def _relevant(name: str, kb) -> bool:
    return name in kb.env or any(name.startswith(p) for p in kb.lint_prefixes)


def _finding(name: str, value: str, severity: str, cause: str, use: str, status: str, source: str) -> Finding:
    return Finding(category="env_invalid", cause=cause, remedy=f"use {use}" if use else "remove it",
                   severity=severity, id=f"env:{name}", source=source or "NCCL user guide; PyTorch ProcessGroupNCCL",
                   evidence=[f"{name}={value}"], extra={"variable": name, "value": value, "use": use, "status": status})


def _lint_alloc_conf(name: str, value: str, kb) -> list[Finding]:
    out = []
    for item in filter(None, (s.strip() for s in value.split(","))):
        key = item.split(":", 1)[0].strip()
        if key not in kb.alloc_conf_keys:
            close = difflib.get_close_matches(key, sorted(kb.alloc_conf_keys), n=1)
            out.append(_finding(name, value, "error",
                                f"{name}: '{key}' is not an allocator option (PyTorch refuses to start with it)",
                                f"{close[0]}" if close else "one of " + ", ".join(sorted(kb.alloc_conf_keys)),
                                "invented", "PyTorch CUDA semantics (PYTORCH_CUDA_ALLOC_CONF)"))
    return out


def lint_env(env: Mapping[str, str], production: bool = True, world_size: int | None = None) -> list[Finding]:
    """Findings for the communication-related variables in `env` (other variables are ignored).

    error: the variable does not exist, is deprecated, or (production) is a debug-only knob with a harmful value;
    warn: an undocumented NCCL_/TORCH_NCCL_ name (NCCL ignores unknown names silently: usually a typo), or a
    harmful value outside production; info: debug knobs outside production.
    """
    kb = load()
    out: list[Finding] = []
    for name in sorted(env):
        if not _relevant(name, kb):
            continue
        value = str(env[name])
        r = kb.env.get(name)
        if name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            out += _lint_alloc_conf(name, value, kb)
            continue
        if r is None:
            close = difflib.get_close_matches(name, [k for k, e in kb.env.items() if e["status"] != "invented"], n=1,
                                              cutoff=0.75)
            out.append(_finding(name, value, "warn",
                                f"{name} is not a variable NCCL or PyTorch documents; unknown names are ignored "
                                "silently, so this is usually a typo",
                                close[0] if close else "", "unknown", "NCCL user guide (environment variables)"))
            continue
        status, use, why, src = r["status"], str(r.get("use") or ""), str(r.get("why") or ""), str(r.get("source") or "")
        if status == "invented":
            out.append(_finding(name, value, "error", f"{name} does not exist: {why}", use, status, src))
        elif status == "deprecated":
            out.append(_finding(name, value, "error", f"{name} is deprecated: {why}", use, status, src))
        elif status == "debug":
            if r["bad"] and value.strip().upper() not in r["bad"]:
                continue
            sev = "error" if production else "info"
            where = "a debug-only knob in production" if production else "a debug-only knob (fine while debugging)"
            out.append(_finding(name, value, sev, f"{name}={value} is {where}: {why}", use, status, src))
        elif status == "known" and r["bad"] and value.strip().upper() in r["bad"]:
            above = r.get("required_above_gpus")
            sev = "error" if (above and world_size and world_size > int(above)) else "warn"
            out.append(_finding(name, value, sev, f"{name}={value}: {why}", use, status, src))
    return out


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "error"]


def relevant_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of an environment the lint looks at."""
    kb = load()
    return {k: str(v) for k, v in environ.items() if _relevant(k, kb)}
