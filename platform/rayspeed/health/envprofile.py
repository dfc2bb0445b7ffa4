"""Environment profiles by cluster size, and the lint that rejects variables nothing reads.

env_profile(cfg, world_size) -> {name: value}     what the workers' runtime environment gets
profile(cfg, world_size) -> dict                  the same with the tier, the notes and where each value came from
lint_env(env, production=True, world_size=None)   Findings for invented, deprecated and debug-only variables

The profile is the planner's communication rule (PLAYBOOK B.2, rayspeed.planner.rules.comm_profile) for this
job's size and hardware, with the job's own `cluster.env` on top (the user's value wins, and is linted).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from rayspeed.config import env_lint
from rayspeed.config.env_lint import EnvIssue
from rayspeed.health.knowledge import Finding
from rayspeed.redact import redact_mapping, redact_value

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
    """One log line: the tier and every variable with where it came from (secret values masked)."""
    parts = [f"{k}={redact_value(k, v)}" + (" (cluster.env)" if k in prof["from_cluster_env"] else "")
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


def redacted(prof: Mapping[str, Any]) -> dict[str, Any]:
    """The profile for output (healthcheck report, logs): values of secret-named variables masked."""
    return redact_mapping(dict(prof))


def to_finding(issue: EnvIssue) -> Finding:
    value = redact_value(issue.variable, issue.value)
    return Finding(category="env_invalid", cause=issue.cause, remedy=issue.remedy, severity=issue.severity,
                   id=f"env:{issue.variable}", source=issue.source, evidence=[f"{issue.variable}={value}"],
                   extra={"variable": issue.variable, "value": value, "use": issue.use, "status": issue.status})


def lint_env(env: Mapping[str, str], production: bool = True, world_size: int | None = None) -> list[Finding]:
    """rayspeed.config.env_lint's issues with `env`, as doctor findings."""
    return [to_finding(i) for i in env_lint.lint_env(env, production, world_size)]


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "error"]
