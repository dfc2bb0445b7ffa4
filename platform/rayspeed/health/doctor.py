"""`rayspeed doctor`: read a job's log and name what went wrong, why, and what to change.

    rayspeed doctor [LOGFILE|-|RAY_JOB_ID] [--json] [--config FILE [--set K=V]...] [--address URL]
    rayspeed doctor --env [ENVFILE|-] [--json] [--config FILE] [--workers N] [--debug]

Every signature, cause, remedy and source comes from knowledge.yaml; this module only matches and measures:
regex signatures line by line, plus a few detectors over numbers in the log (grad-norm spikes, throughput drops,
NCCL INFO flooding, environment assignments). An OOM is explained with the planner's view of the job when the
log (`--config FILE` on the command line it shows) or --config gives the job file.

--env lints an environment instead: ENVFILE holds NAME=VALUE lines (`env | rayspeed doctor --env -`); without
one, this process's environment plus, with --config, the job's profile and cluster.env.

Exit 0: nothing at error severity; 1: errors found; 2: bad input (no such file, no such job).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Iterable

from rayspeed.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, ConfigError
from rayspeed.health.envprofile import lint_env
from rayspeed.health.knowledge import Finding, Knowledge, load

MAX_EVIDENCE = 3
_FLOAT = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_GRAD_NORM = re.compile(rf"grad[-_ ]?norm[\"']?\s*[=:]?\s*({_FLOAT}|nan|inf)", re.IGNORECASE)
_TOKENS = re.compile(rf"({_FLOAT})\s*tok(?:ens)?/s|tokens_per_s[\"']?\s*[=:]\s*({_FLOAT})", re.IGNORECASE)
_SEC_STEP = re.compile(rf"({_FLOAT})\s*s/step|step_time_s[\"']?\s*[=:]\s*({_FLOAT})", re.IGNORECASE)
_ENV_ASSIGN = re.compile(r"\b((?:NCCL|TORCH_NCCL|TORCH_DISTRIBUTED|TORCH_GLOO|PYTORCH_CUDA|PYTORCH_NO_CUDA|CUDA_LAUNCH)"
                         r"[A-Z0-9_]*)=([^\s,;'\"\]\)}]*)")
_NCCL_SET_BY_ENV = re.compile(r"\b(NCCL_[A-Z0-9_]+) set by environment to (\S+)")
_ENV_NAME = r"(?:NCCL|TORCH_NCCL|TORCH_DISTRIBUTED|TORCH_GLOO|PYTORCH_CUDA|PYTORCH_NO_CUDA|CUDA_LAUNCH)[A-Z0-9_]*"
_ENV_DICT = re.compile(rf"['\"]({_ENV_NAME})['\"]\s*:\s*['\"]([^'\"]*)['\"]")
# Leading log decorations: [rayspeed rank 0], (RayTrainWorker pid=1), timestamps, levels, shell trace "+".
_LOG_PREFIX = re.compile(r"^(?:\s*(?:\[[^\]]*\]|\([^)]*\)|\d{4}-\d\d-\d\d[ T][\d:.,]+|[A-Z]\d{4} [\d:.]+|"
                         r"INFO|WARNING|WARN|ERROR|DEBUG|\+)[:\s]*)*")
_ENV_LINE_START = re.compile(rf"^(?:export\s+|env\s+|declare -x\s+)?{_ENV_NAME}=")
_NCCL_INFO = re.compile(r"\bNCCL INFO\b")
_CONFIG_IN_LOG = re.compile(r"--config[= ]+(\S+\.ya?ml)\b")
_SET_IN_LOG = re.compile(r"--set[= ]+(\S+=\S+)")
_PLAN_IN_LOG = re.compile(r"plan: dp=(\d+) tp=(\d+) pp=(\d+) zero=(\d+) micro=(\d+) accum=(\d+) ac=(\w+)")
_STEP = re.compile(r"\bstep[ =:]+(\d+)\b", re.IGNORECASE)
_GIB = re.compile(rf"({_FLOAT})\s*(GiB|MiB|KiB|GB|MB)")
_JOB_ID = re.compile(r"^(raysubmit_[A-Za-z0-9]+|[0-9a-f]{8,}|[A-Za-z][A-Za-z0-9_-]{2,})$")


def _ev(lines: list[str], i: int) -> str:
    return f"line {i + 1}: {lines[i].strip()[:300]}"


def _gib(text: str) -> float | None:
    m = _GIB.search(text)
    if not m:
        return None
    v = float(m.group(1))
    return v * {"GiB": 1, "GB": 1, "MiB": 1 / 1024, "MB": 1 / 1024, "KiB": 1 / 1024**2}[m.group(2)]


# ---------------------------------------------------------------- signatures


def _signatures(lines: list[str], kb: Knowledge) -> list[Finding]:
    out = []
    for e in kb.entries:
        if not e.signature:
            continue
        hits = [i for i, line in enumerate(lines) if any(rx.search(line) for rx in e.signature)]
        if hits:
            f = e.finding(evidence=[_ev(lines, i) for i in hits[:MAX_EVIDENCE]], count=len(hits), first_line=hits[0] + 1)
            out.append(f)
    return out


# ---------------------------------------------------------------- detectors


def _values(lines: list[str], rx: re.Pattern) -> list[tuple[int, float]]:
    out = []
    for i, line in enumerate(lines):
        for m in rx.finditer(line):
            raw = next(g for g in m.groups() if g is not None)
            try:
                out.append((i, float(raw)))
            except ValueError:
                continue
    return out


def grad_norm_spikes(lines: list[str], factor: float = 10.0, window: int = 20) -> list[tuple[int, float, float]]:
    """(line index, norm, median before it) for each finite grad norm above factor x the median of the previous
    `window` finite norms (at least 3 known)."""
    spikes, hist = [], []
    for i, v in _values(lines, _GRAD_NORM):
        if v != v or v in (float("inf"), float("-inf")):
            continue
        if len(hist) >= 3:
            med = statistics.median(hist[-window:])
            if med > 0 and v > factor * med:
                spikes.append((i, v, med))
                continue  # a spike does not raise the baseline
        hist.append(v)
    return spikes


def throughput_series(lines: list[str]) -> list[tuple[int, float]]:
    """Throughput samples (higher is better): tokens/s where the log has them, else 1 / (s/step)."""
    tok = _values(lines, _TOKENS)
    if len(tok) >= 4:
        return tok
    return [(i, 1.0 / v) for i, v in _values(lines, _SEC_STEP) if v > 0]


def throughput_drop(series: list[tuple[int, float]], drop: float = 0.3) -> dict | None:
    """A sustained drop: the median of the later samples below (1 - drop) x the median of the earlier ones.
    The first sample is left out (compilation, warm-up, first allocations)."""
    vals = series[1:]
    if len(vals) < 6:
        return None
    half = len(vals) // 2
    base = statistics.median(v for _, v in vals[:half])
    recent = statistics.median(v for _, v in vals[half:])
    # The worst stretch of 3 consecutive samples, for a dip that recovered.
    worst_i, worst = min(((k, statistics.median(v for _, v in vals[k:k + 3])) for k in range(len(vals) - 2)),
                         key=lambda t: t[1])
    if base <= 0:
        return None
    if recent < (1 - drop) * base:
        first = next((i for i, v in vals[half:] if v < (1 - drop) * base), vals[half][0])
        return {"baseline": base, "recent": recent, "line": first, "sustained": True}
    if worst < (1 - 2 * drop) * base:
        return {"baseline": base, "recent": worst, "line": vals[worst_i][0], "sustained": False}
    return None


def _env_like(line: str) -> bool:
    """A line that sets variables (`export X=1`, `X=1 python ...`, an env dump, rayspeed's profile line), as opposed
    to prose that mentions one: PyTorch and NCCL messages say "run with NCCL_DEBUG=INFO for details" or
    "(TORCH_NCCL_ENABLE_MONITORING=0)", which must not be read as the job's settings."""
    if "env profile for" in line:
        return True
    rest = _LOG_PREFIX.sub("", line, count=1)
    return bool(_ENV_LINE_START.match(rest))


def env_from_log(lines: Iterable[str]) -> dict[str, tuple[str, int]]:
    """NAME -> (value, line index) for every communication variable the log shows being set."""
    env: dict[str, tuple[str, int]] = {}
    for i, line in enumerate(lines):
        if _env_like(line):
            for m in _ENV_ASSIGN.finditer(line):
                if m.start() == 0 or line[m.start() - 1].isspace():
                    env[m.group(1)] = (m.group(2), i)
        if "env" in line.lower():
            for m in _ENV_DICT.finditer(line):
                env[m.group(1)] = (m.group(2), i)
        for m in _NCCL_SET_BY_ENV.finditer(line):
            env[m.group(1)] = (m.group(2), i)
    return env


def _detectors(lines: list[str], kb: Knowledge, production: bool) -> list[Finding]:
    out: list[Finding] = []
    spikes = grad_norm_spikes(lines)
    if spikes:
        e = kb.entry("grad_norm_spike")
        out.append(e.finding(evidence=[f"{_ev(lines, i)} (norm {v:.4g} vs median {m:.4g})" for i, v, m in spikes[:MAX_EVIDENCE]],
                             count=len(spikes), first_line=spikes[0][0] + 1))
    d = throughput_drop(throughput_series(lines))
    if d:
        e = kb.entry("throughput_drop")
        pct = 100 * (1 - d["recent"] / d["baseline"])
        what = "fell and stayed down" if d["sustained"] else "dipped"
        out.append(e.finding(evidence=[_ev(lines, d["line"])],
                             cause=f"throughput {what}: {pct:.0f}% below its earlier median. " + e.cause,
                             first_line=d["line"] + 1, drop_fraction=round(pct / 100, 3)))
    env = env_from_log(lines)
    if env:
        for f in lint_env({k: v for k, (v, _) in env.items()}, production=production):
            if f.severity == "info":
                continue
            i = env[f.extra["variable"]][1]
            f.evidence = [_ev(lines, i)]
            f.extra["first_line"] = i + 1
            out.append(f)
    info = [i for i, line in enumerate(lines) if _NCCL_INFO.search(line)]
    if len(info) >= 5 and production:
        e = kb.entry("nccl_debug_info_in_production")
        out.append(e.finding(evidence=[_ev(lines, i) for i in info[:2]], count=len(info), variable="NCCL_DEBUG",
                             use="NCCL_DEBUG=WARN"))
    return out


# ---------------------------------------------------------------- OOM, with the planner's view


def _oom_details(lines: list[str], first: int) -> dict[str, Any]:
    d: dict[str, Any] = {}
    window = " ".join(lines[first:first + 6])
    m = re.search(rf"Tried to allocate ({_FLOAT}\s*(?:GiB|MiB|KiB|GB|MB))", window)
    if m:
        d["tried_gib"] = _gib(m.group(1))
    m = re.search(rf"total capacity of ({_FLOAT}\s*(?:GiB|MiB|GB|MB))", window)
    if m:
        d["capacity_gib"] = _gib(m.group(1))
    m = re.search(rf"({_FLOAT}\s*(?:GiB|MiB|GB|MB)) is allocated by PyTorch", window)
    if m:
        d["allocated_gib"] = _gib(m.group(1))
    m = re.search(rf"({_FLOAT}\s*(?:GiB|MiB|GB|MB)) is reserved by PyTorch but unallocated", window)
    if m:
        d["reserved_unallocated_gib"] = _gib(m.group(1))
    steps = [int(m.group(1)) for line in lines[:first] for m in _STEP.finditer(line)]
    if not steps and any("first step done" in line for line in lines[:first]):
        steps = [1]
    d["last_step_before"] = steps[-1] if steps else None
    return d


def _planner_view(cfg, lines: list[str]) -> dict[str, Any]:
    """What the planner says about the job: the layout the log ran (if it says), and the best fitting one."""
    from rayspeed.planner import evaluate_layout, plan_job

    view: dict[str, Any] = {}
    m = None
    for line in lines:
        m = _PLAN_IN_LOG.search(line) or m
    world = None
    if m:
        lay = dict(zip(("dp", "tp", "pp", "zero_stage", "micro_batch_size", "grad_accum"), map(int, m.groups()[:6])))
        lay["activation_checkpointing"] = m.group(7)
        world = lay["dp"] * lay["tp"] * lay["pp"]
        ran = evaluate_layout(cfg, lay, world_size=world)
        view["ran"] = {**lay, "memory_gib_per_gpu": ran.get("memory_gib_per_gpu"), "fits": ran.get("fits"),
                       "usable_memory_gib": ran.get("usable_memory_gib"), "reason": ran.get("reason")}
    try:
        best = plan_job(cfg, world_size=world).best
        view["best"] = {k: best.get(k) for k in ("dp", "tp", "pp", "zero_stage", "micro_batch_size", "grad_accum",
                                                   "activation_checkpointing", "memory_gib_per_gpu", "fits")}
    except ConfigError as e:
        view["best"] = None
        view["no_fit"] = e.render()
    return view


def _explain_oom(f: Finding, lines: list[str], cfg) -> None:
    d = _oom_details(lines, f.extra.get("first_line", 1) - 1)
    f.extra["oom"] = d
    notes = []
    unalloc, cap = d.get("reserved_unallocated_gib"), d.get("capacity_gib")
    frag = unalloc is not None and (unalloc >= 0.05 * (cap or 0) or unalloc >= (d.get("tried_gib") or 0) > 0)
    if frag:
        f.cause = (f"fragmentation: {unalloc:.2f} GiB is reserved by PyTorch but unallocated (the allocation of "
                   f"{d.get('tried_gib') or 0:.2f} GiB could not be placed in it). " + f.cause)
        f.remedy = ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (or garbage_collection_threshold:0.9) in "
                    "cluster.env; then, if it still runs out, change the layout. " + f.remedy)
    elif unalloc is not None:
        f.cause = (f"not fragmentation (only {unalloc:.2f} GiB reserved but unallocated"
                   + (f" of {cap:.1f} GiB" if cap else "") + "): the layout needs more memory than the GPU has. "
                   + f.cause)
    if d.get("last_step_before") is not None and d["last_step_before"] <= 2:
        notes.append(f"it failed right after step {d['last_step_before']}: the optimizer state is allocated by the "
                     "first step, so the layout needs the memory of a full step, not just of the forward pass")
    if cfg is not None:
        try:
            view = _planner_view(cfg, lines)
        except Exception as e:  # the diagnosis must not fail because the job file no longer plans
            view = {"error": str(e)[:300]}
        f.extra["planner"] = view
        ran, best = view.get("ran"), view.get("best")
        if ran and ran.get("memory_gib_per_gpu") is not None:
            notes.append(f"the planner predicts the layout in the log (dp{ran['dp']} tp{ran['tp']} pp{ran['pp']} "
                         f"zero{ran['zero_stage']} mb{ran['micro_batch_size']} ga{ran['grad_accum']} "
                         f"ckpt={ran['activation_checkpointing']}) needs {ran['memory_gib_per_gpu']:.1f} GiB per GPU of "
                         f"{ran.get('usable_memory_gib') or 0:.1f} usable")
        if best:
            changes = [f"parallel.{k}={best[k]}" for k in ("zero_stage", "micro_batch_size", "grad_accum",
                                                          "activation_checkpointing", "tp", "pp")
                       if not ran or ran.get(k) != best[k]]
            notes.append(f"the planner's best fitting layout needs {best['memory_gib_per_gpu']:.1f} GiB per GPU: "
                         + (", ".join(changes) if changes else "the same layout (so suspect fragmentation or "
                            "memory outside the model: another process on the GPU)")
                         + " (or leave parallel.* auto)")
        elif view.get("no_fit"):
            notes.append("the planner finds no layout that fits this job on this cluster: " + view["no_fit"])
    if notes:
        f.remedy = f.remedy + " For this job: " + "; ".join(notes) + "."


# ---------------------------------------------------------------- diagnose


def _config_from_log(lines: list[str], base: Path | None) -> Any:
    """The job file named on the command line the log shows, with that line's --set overrides except the
    parallel.* ones: the planner is asked what it would choose, not what the failed run was forced into."""
    from rayspeed.config.load import load as load_job

    for line in lines:
        m = _CONFIG_IN_LOG.search(line)
        if not m:
            continue
        sets = [s for s in _SET_IN_LOG.findall(line) if not s.startswith("parallel.")]
        # As written (absolute, or relative to here), else relative to the log's folder or any folder above it
        # (a log saved inside the repository that ran the job).
        roots = [Path.cwd()] + ([base, *base.parents] if base else [])
        for cand in [Path(m.group(1))] + [r / m.group(1) for r in roots]:
            if cand.is_file():
                try:
                    return load_job(str(cand), sets)
                except ConfigError:
                    return None
    return None


def diagnose(text: str, cfg=None, production: bool = True, log_dir: Path | None = None) -> list[Finding]:
    """Findings for a log, most severe first, each category's first occurrence first."""
    kb = load()
    lines = text.splitlines()
    found = _detectors(lines, kb, production) + _signatures(lines, kb)
    # One finding per variable (the lint and PyTorch's own deprecation warning may both name it).
    seen_vars = set()
    unique = []
    for f in found:
        var = f.extra.get("variable")
        if f.id == "deprecated_env_warning":
            m = re.search(r"Environment variable (\w+) is deprecated; use (\w+)", " ".join(f.evidence))
            if m:
                var = m.group(1)
                f.extra.update(variable=var, use=m.group(2))
                f.remedy = f"use {m.group(2)} instead of {var}"
        if var:
            if var in seen_vars:
                continue
            seen_vars.add(var)
        unique.append(f)
    if any(f.category == "oom" and f.id == "cuda_oom" for f in unique):
        cfg = cfg if cfg is not None else _config_from_log(lines, log_dir)
        for f in unique:
            if f.id == "cuda_oom":
                _explain_oom(f, lines, cfg)
    rank = {"error": 0, "warn": 1, "info": 2}
    unique.sort(key=lambda f: (rank.get(f.severity, 3), f.extra.get("first_line", 0)))
    return unique


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
        out.append(f"    fix: {f.remedy}")
        out.append(f"    source: {f.source}")
    return "\n".join(out)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="rayspeed doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("source", nargs="?", help="log file, '-' for stdin, or a Ray job id (with --env: NAME=VALUE lines)")
    ap.add_argument("--env", action="store_true", help="lint environment variables instead of reading a log")
    ap.add_argument("--json", action="store_true", help='one JSON object: {"findings": [...]}')
    ap.add_argument("--config", help="the job file (OOM advice from the planner; --env: its profile and cluster.env)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a job-file key")
    ap.add_argument("--workers", type=int, help="--env: cluster size for the profile (default: the job's)")
    ap.add_argument("--address", help="Ray dashboard / Jobs API address for a job id (default: RAY_API_SERVER_ADDRESS "
                                      "or http://127.0.0.1:8265)")
    ap.add_argument("--debug", action="store_true", help="not a production run: debug knobs are information only")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:
        return EXIT_OK if e.code == 0 else EXIT_BAD_INPUT
    production = not args.debug
    try:
        cfg = None
        if args.config:
            from rayspeed.config.load import load as load_job

            cfg = load_job(args.config, args.set)
            production = production and cfg.health.production
        if args.env:
            findings, source, extra = _env_mode(args, cfg, production)
        else:
            if not args.source:
                raise ConfigError("rayspeed doctor: give a log file, '-' for stdin, or a Ray job id (or --env)")
            text, source = read_source(args.source, args.address)
            log_dir = Path(args.source).resolve().parent if source not in ("stdin",) and Path(args.source).is_file() else None
            findings, extra = diagnose(text, cfg, production, log_dir), {"lines": len(text.splitlines())}
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps({"source": source, **extra, "findings": [f.to_json() for f in findings]}, default=str))
    else:
        print(render(findings, source))
    return EXIT_FAILED if any(f.severity == "error" for f in findings) else EXIT_OK


def _env_mode(args, cfg, production: bool) -> tuple[list[Finding], str, dict]:
    from rayspeed.health.envprofile import profile, relevant_env

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
