"""Checks of the job file's health and cluster.env keys, for the loader: each problem names its key and the fix,
so a bad value exits 2 before anything starts instead of failing a worker later.

    problems(cfg) -> list[str]      [] when fine; else raise ConfigError(problems)
"""

from __future__ import annotations

from rayspeed.health.envprofile import lint_env


def problems(cfg) -> list[str]:
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
    env = getattr(cfg.cluster, "env", None) or {}
    for f in lint_env(env, production=h.production, world_size=cfg.cluster.max_workers):
        if f.severity == "error":
            out.append(f"cluster.env.{f.extra['variable']}: {f.cause}; {f.remedy}")
    return out
