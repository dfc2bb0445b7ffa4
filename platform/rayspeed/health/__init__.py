"""rayspeed.health: cluster health checks, environment profiles, the doctor and the training watchdog.

    run_preflight(cfg, groups, device) -> PreflightReport     on every rank before step 0; raises PreflightError
    env_profile(cfg, world_size) -> {name: value}             the workers' environment for this cluster size
    lint_env(env, production=True, world_size=None)           Findings for invented / deprecated / debug variables
    Watchdog(policy, spike_factor, window).check(step, loss, grad_norm) -> Decision(action, reason)
    allreduce_sweep / allgather_sweep                         nccl-tests-style sweeps on an initialized group

Commands: `rayspeed healthcheck` (healthcheck.py) and `rayspeed doctor` (doctor.py). What the platform knows
about failures lives in knowledge.yaml. Names are imported lazily: the doctor and the lint need no torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "run_preflight": "rayspeed.health.preflight",
    "PreflightError": "rayspeed.health.preflight",
    "PreflightReport": "rayspeed.health.preflight",
    "env_profile": "rayspeed.health.envprofile",
    "log_profile": "rayspeed.health.envprofile",
    "lint_env": "rayspeed.health.envprofile",
    "Watchdog": "rayspeed.health.watchdog",
    "Decision": "rayspeed.health.watchdog",
    "allreduce_sweep": "rayspeed.health.collectives",
    "allgather_sweep": "rayspeed.health.collectives",
    "Finding": "rayspeed.health.knowledge",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rayspeed.health' has no attribute {name!r}")
