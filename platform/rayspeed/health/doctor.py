"""`rayspeed doctor`: read a job's log and name what went wrong, why, and what to change.

    rayspeed doctor [LOGFILE|-|RAY_JOB_ID] [--json] [--config FILE [--set K=V]...] [--address URL]
    rayspeed doctor --env [ENVFILE|-] [--json] [--config FILE] [--workers N] [--debug]

Every signature, cause, remedy and source comes from knowledge.yaml. The log is read by diagnosis.diagnose:
regex signatures line by line plus detectors over the numbers and stack dumps in the log (log_detectors), an
OOM explained with the planner's view of the job (oom_advice), and the findings ranked so that the one that
explains the failure comes first (ranking). This module is the command line.

--env lints an environment instead: ENVFILE holds NAME=VALUE lines (`env | rayspeed doctor --env -`); without
one, this process's environment plus, with --config, the job's profile and cluster.env.

Exit 0: nothing at error severity; 1: errors found; 2: bad input (no such file, no such job).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from rayspeed.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, ConfigError
from rayspeed.health.diagnosis import diagnose
from rayspeed.health.envprofile import lint_env
from rayspeed.health.knowledge import CATEGORIES, Finding
from rayspeed.health.log_detectors import (
    MAX_EVIDENCE,
    env_from_log,
    grad_norm_spikes,
    throughput_drop,
    throughput_series,
)
from rayspeed.health.ranking import CATEGORY_TIERS, TIER_NAMES

__all__ = ["diagnose", "doctor_command", "categories_epilog", "render", "read_source", "parse_env_lines",
           "fetch_job_logs", "grad_norm_spikes", "throughput_series", "throughput_drop", "env_from_log",
           "CATEGORY_MEANINGS"]

_JOB_ID = re.compile(r"^(raysubmit_[A-Za-z0-9]+|[0-9a-f]{8,}|[A-Za-z][A-Za-z0-9_-]{2,})$")

# What each category of the JSON output means (`--help` lists them; the category names are a public interface).
CATEGORY_MEANINGS = {
    "oom": "a GPU or a host ran out of memory (CUDA OOM, Ray's memory monitor, the Linux OOM killer)",
    "shm_exhausted": "/dev/shm too small or full: NCCL or the DataLoader could not create shared memory",
    "network": "the network between ranks failed: IB completion errors, socket failures, a fallback to TCP",
    "worker_died": "a Ray worker or node died (actor died, worker crashed, node marked dead) without a known cause",
    "checkpoint_missing": "a checkpoint file to resume from is not there (ZeRO shards, model states, 'latest')",
    "checkpoint_corrupt": "a checkpoint is truncated, corrupted or failed its manifest check",
    "nan_loss": "the loss became NaN or Inf",
    "grad_explosion": "the gradient norm spiked, blew up or stopped being finite",
    "nccl_timeout": "a collective timed out or failed (NCCL watchdog, desync report, gloo timeout)",
    "hang": "no progress: ranks stuck in a collective (py-spy), a stuck watchdog, a deadlock",
    "rank_failed": "a rank of the healthcheck failed",
    "slow_throughput": "step throughput dropped well below its earlier level",
    "slow_rank": "one rank or node measured well below the others",
    "topology": "GPU pairs without NVLink, GPUs spread over NUMA nodes",
    "bandwidth": "collective bus bandwidth far below the hardware, or a wrong collective result",
    "env_invalid": "an environment variable is invented, deprecated or a debug knob in production",
}


def categories_epilog() -> str:
    """`rayspeed doctor --help`'s list of categories, in the order findings are ranked."""
    width = max(map(len, CATEGORIES))
    out = ["categories, in the order findings are ranked (what explains the failure first; info-level notes last):"]
    for tier, name in enumerate(TIER_NAMES):
        cats = [c for c in CATEGORIES if CATEGORY_TIERS.get(c) == tier]
        if cats:
            out.append(f" {name}:")
            out += [f"  {c:<{width}}  {CATEGORY_MEANINGS.get(c, '')}" for c in cats]
    return "\n".join(out)


# ---------------------------------------------------------------- sources


def fetch_job_logs(job_id: str, address: str | None = None) -> str:
    """A Ray job's driver log through the Jobs API (what `ray job logs JOB_ID` prints)."""
    if "RAY_AUTH_MODE" not in os.environ and (Path.home() / ".ray" / "auth_token").exists():
        os.environ["RAY_AUTH_MODE"] = "token"  # clusters started by `make up` refuse clients without the token
    from ray.job_submission import JobSubmissionClient

    addr = address or os.environ.get("RAY_API_SERVER_ADDRESS") or "http://127.0.0.1:8265"
    try:
        client = JobSubmissionClient(addr)
        return client.get_job_logs(job_id)
    except Exception as e:
        raise ConfigError(f"{job_id}: not a file, and the Ray Jobs API at {addr} has no such job "
                          f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__}); pass a log file, "
                          "'-' for stdin, or --address for another cluster") from None


def read_source(source: str, address: str | None = None) -> tuple[str, str]:
    """(text, description) of a log: a file, '-' (stdin), or a Ray job id."""
    if source == "-":
        return sys.stdin.read(), "stdin"
    p = Path(source)
    if p.is_file():
        return p.read_text(errors="replace"), str(p)
    if p.exists():
        raise ConfigError(f"{source}: not a regular file")
    if "/" in source or "." in source or not _JOB_ID.match(source):
        raise ConfigError(f"{source}: no such file")
    return fetch_job_logs(source, address), f"ray job {source}"


def parse_env_lines(text: str) -> dict[str, str]:
    """NAME=VALUE lines (`env` output, a dotenv file; `export ` prefixes and quotes allowed)."""
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        if line.startswith("export "):
            line = line[7:].strip()
        k, v = line.split("=", 1)
        if re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k.strip()):
            env[k.strip()] = v.strip().strip("'\"")
    return env


# ---------------------------------------------------------------- output


def render(findings: list[Finding], source: str) -> str:
    if not findings:
        return f"rayspeed doctor: {source}: nothing found"
    out = [f"rayspeed doctor: {source}: {len(findings)} finding(s)"]
    for f in findings:
        out.append(f"[{f.severity}] {f.category}: {f.cause}")
        for e in f.evidence[:MAX_EVIDENCE]:
            out.append(f"    {e}")
        for e in f.extra.get("led_to", [])[:MAX_EVIDENCE]:
            out.append(f"    led to: {e}")
        if f.extra.get("follows"):
            out.append(f"    follows: {f.extra['follows']} (likely its consequence)")
        out.append(f"    fix: {f.remedy}")
        out.append(f"    source: {f.source}")
    return "\n".join(out)


def doctor_command(args: argparse.Namespace) -> int:
    production = not args.debug
    try:
        cfg = None
        if args.config:
            from rayspeed.config.load import load as load_job

            # --env lints cluster.env itself: loading must not refuse the job for what the lint reports.
            cfg = load_job(args.config, args.overrides, lint_cluster_env=not args.env)
            production = production and cfg.health.production
        if args.env:
            findings, source, extra = _env_mode(args, cfg, production)
        else:
            if not args.source:
                raise ConfigError("rayspeed doctor: give a log file, '-' for stdin, or a Ray job id (or --env)")
            text, source = read_source(args.source, args.address)
            log_dir = (Path(args.source).resolve().parent
                       if source not in ("stdin",) and Path(args.source).is_file() else None)
            findings, extra = diagnose(text, cfg, production, log_dir), {"lines": len(text.splitlines())}
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_BAD_INPUT
    from rayspeed.redact import redact_mapping, redact_text

    if args.json:  # the environment and the log's lines may carry secrets: none reach the output
        print(json.dumps(redact_mapping({"source": source, **extra, "findings": [f.to_json() for f in findings]}),
                         default=str))
    else:
        print(redact_text(render(findings, source)))
    return EXIT_FAILED if any(f.severity == "error" for f in findings) else EXIT_OK


def _env_mode(args, cfg, production: bool) -> tuple[list[Finding], str, dict]:
    from rayspeed.config.env_lint import relevant_env
    from rayspeed.health.envprofile import profile

    extra: dict[str, Any] = {}
    if args.source:
        if args.source == "-":
            env, source = parse_env_lines(sys.stdin.read()), "stdin"
        elif Path(args.source).is_file():
            env, source = parse_env_lines(Path(args.source).read_text(errors="replace")), args.source
        else:
            raise ConfigError(f"{args.source}: no such file (--env reads NAME=VALUE lines from a file or '-')")
        env = relevant_env(env)
    else:
        env, source = relevant_env(os.environ), "this environment"
    world = args.workers
    if cfg is not None:
        prof = profile(cfg, world)
        world = prof["world_size"]
        env.update(prof["env"])
        source += f" + the job's profile for {world} workers ({prof['tier']})"
        extra["env_profile"] = {"tier": prof["tier"], "env": prof["env"]}
    extra["env"] = env
    return lint_env(env, production=production, world_size=world), source, extra
