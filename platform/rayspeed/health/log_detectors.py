"""Detectors over the numbers and structure of a log, for `rayspeed doctor`.

Signatures (regexes in knowledge.yaml) see one line at a time; these see a series: the gradient norm over the
run, the step throughput, the environment the log shows being set, py-spy stack dumps of every rank, and how
many NCCL INFO lines there are. Each returns plain data; `detector_findings` turns it into Findings under the
knowledge entry that carries the cause and the remedy.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from typing import Iterable

from rayspeed.health.envprofile import lint_env
from rayspeed.health.knowledge import Finding, Knowledge

MAX_EVIDENCE = 3
FLOAT = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
# The value may be quoted: transformers' ProgressCallback prints floats as strings ({'grad_norm': '1.234'}),
# older versions print them bare ({'grad_norm': 1.234}, {'grad_norm': nan}).
_GRAD_NORM = re.compile(rf"grad[-_ ]?norm[\"']?\s*[=:]?\s*[\"']?({FLOAT}|nan|inf)", re.IGNORECASE)
_TOKENS = re.compile(rf"({FLOAT})\s*tok(?:ens)?/s|tokens_per_s[\"']?\s*[=:]\s*({FLOAT})", re.IGNORECASE)
_SEC_STEP = re.compile(rf"({FLOAT})\s*s/step|step_time_s[\"']?\s*[=:]\s*({FLOAT})", re.IGNORECASE)
_ENV_NAME = r"(?:NCCL|TORCH_NCCL|TORCH_DISTRIBUTED|TORCH_GLOO|PYTORCH_CUDA|PYTORCH_NO_CUDA|CUDA_LAUNCH)[A-Z0-9_]*"
_ENV_ASSIGN = re.compile(rf"\b({_ENV_NAME})=([^\s,;'\"\]\)}}]*)")
_NCCL_SET_BY_ENV = re.compile(r"\b(NCCL_[A-Z0-9_]+) set by environment to (\S+)")
_ENV_DICT = re.compile(rf"['\"]({_ENV_NAME})['\"]\s*:\s*['\"]([^'\"]*)['\"]")
# Leading log decorations: [rayspeed rank 0], (RayTrainWorker pid=1), timestamps, levels, shell trace "+".
_LOG_PREFIX = re.compile(r"^(?:\s*(?:\[[^\]]*\]|\([^)]*\)|\d{4}-\d\d-\d\d[ T][\d:.,]+|[A-Z]\d{4} [\d:.]+|"
                         r"INFO|WARNING|WARN|ERROR|DEBUG|\+)[:\s]*)*")
_ENV_LINE_START = re.compile(rf"^(?:export\s+|env\s+|declare -x\s+)?{_ENV_NAME}=")
_NCCL_INFO = re.compile(r"\bNCCL INFO\b")

# Gradient norms of a healthy LLM run stay within 0.1-100 even at initialisation; 1e5 is orders of magnitude
# past any of them, and 65504 (fp16's largest value) overflowed long before it.
BLOWUP_NORM = 1e5

# py-spy dump: "Process 123: python train.py", 'Thread 0x7F1A (active): "MainThread"' (or a decimal id), then
# one frame per line, innermost first, "function (file.py:line)"; --native adds C frames without ".py:".
_PYSPY_PROCESS = re.compile(r"\bProcess (\d+): (.*)$")
_PYSPY_THREAD = re.compile(r"\bThread (0x[0-9A-Fa-f]+|\d+) \((?:active|idle)[^)]*\): \"([^\"]*)\"")
_PYSPY_PY_FRAME = re.compile(r"^\s+([\w.<>]+) \(([^()\s]+\.py):(\d+)\)\s*$")
_COLLECTIVES = frozenset((
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "broadcast_object_list", "barrier",
    "monitored_barrier", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "send", "recv",
    "batch_isend_irecv", "wait", "synchronize", "inference_all_reduce",
))
# Where a collective's frame lives: c10d's Python API, DeepSpeed's comm wrapper, or torch.cuda.synchronize
# (a host blocked on the stream the NCCL kernel never finishes on).
_COLLECTIVE_FILES = ("torch/distributed/", "deepspeed/comm/", "torch/cuda/__init__.py")


def evidence_line(lines: list[str], i: int) -> str:
    return f"line {i + 1}: {lines[i].strip()[:300]}"


def values_in(lines: list[str], rx: re.Pattern) -> list[tuple[int, float]]:
    """(line index, value) for every match of rx (the first group that matched), NaN and Inf included."""
    out = []
    for i, line in enumerate(lines):
        for m in rx.finditer(line):
            raw = next(g for g in m.groups() if g is not None)
            try:
                out.append((i, float(raw)))
            except ValueError:
                continue
    return out


def _finite(v: float) -> bool:
    return v == v and v not in (float("inf"), float("-inf"))


def grad_norm_spikes(lines: list[str], factor: float = 10.0, window: int = 20) -> list[tuple[int, float, float]]:
    """(line index, norm, median before it) for each finite grad norm above factor x the median of the previous
    `window` finite norms (at least 3 known)."""
    spikes, hist = [], []
    for i, v in values_in(lines, _GRAD_NORM):
        if not _finite(v):
            continue
        if len(hist) >= 3:
            med = statistics.median(hist[-window:])
            if med > 0 and v > factor * med:
                spikes.append((i, v, med))
                continue  # a spike does not raise the baseline
        hist.append(v)
    return spikes


def grad_norm_blowup(lines: list[str], threshold: float = BLOWUP_NORM) -> dict | None:
    """An absolute blow-up, which needs no baseline (the spike test needs three norms before it): a finite norm
    at or above `threshold` (the first norm of the run may already be 1e6), or norms that stay non-finite (two
    in a row, or the last one logged). One isolated Inf is left out: fp16 loss scaling produces it on purpose
    and skips that step."""
    norms = values_in(lines, _GRAD_NORM)
    huge = [(i, v) for i, v in norms if _finite(v) and abs(v) >= threshold]
    stuck = [(i, v) for k, (i, v) in enumerate(norms)
             if not _finite(v) and ((k > 0 and not _finite(norms[k - 1][1])) or k == len(norms) - 1)]
    hits = sorted(huge + stuck)
    if not hits:
        return None
    return {"hits": hits, "first_norm": norms[0][1], "huge": len(huge), "non_finite": len(stuck)}


def throughput_series(lines: list[str]) -> list[tuple[int, float]]:
    """Throughput samples (higher is better): tokens/s where the log has them, else 1 / (s/step)."""
    tok = values_in(lines, _TOKENS)
    if len(tok) >= 4:
        return tok
    return [(i, 1.0 / v) for i, v in values_in(lines, _SEC_STEP) if v > 0]


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


def stuck_collectives(lines: list[str]) -> dict | None:
    """From py-spy dumps in the log: which processes' main threads sit in a collective, and which do not.

    A dump is taken because the job stopped moving; ranks that wait in all_reduce/barrier are waiting for the
    ones that never arrived, so the odd ones out (a main thread anywhere else) are the likely culprits."""
    procs: list[dict] = []
    pid, in_main = None, False
    for i, line in enumerate(lines):
        m = _PYSPY_PROCESS.search(line)
        if m:
            pid, in_main = m.group(1), False
            continue
        m = _PYSPY_THREAD.search(line)
        if m:
            in_main = m.group(2) == "MainThread"
            if in_main:
                procs.append({"pid": pid or m.group(1), "line": i, "frame": None})
            continue
        if in_main and procs[-1]["frame"] is None:
            f = _PYSPY_PY_FRAME.match(line)
            if f:  # the innermost Python frame: where this process is
                procs[-1].update(frame=f"{f.group(1)} ({f.group(2)}:{f.group(3)})", func=f.group(1),
                                 file=f.group(2), line=i)
    procs = [p for p in procs if p["frame"]]
    stuck = [p for p in procs if p["func"] in _COLLECTIVES and any(s in p["file"] for s in _COLLECTIVE_FILES)]
    if not stuck:
        return None
    return {"stuck": stuck, "others": [p for p in procs if p not in stuck], "dumped": len(procs),
            "ops": Counter(p["func"] for p in stuck)}


def nccl_info_lines(lines: list[str]) -> list[int]:
    return [i for i, line in enumerate(lines) if _NCCL_INFO.search(line)]


# ---------------------------------------------------------------- findings


def _grad_findings(lines: list[str], kb: Knowledge) -> list[Finding]:
    blow = grad_norm_blowup(lines)
    if blow:
        e = kb.entry("grad_norm_blowup")
        hits = blow["hits"]
        what = []
        if blow["huge"]:
            what.append(f"{blow['huge']} norm(s) at or above {BLOWUP_NORM:.0e} (the first one logged was "
                        f"{blow['first_norm']:.4g})")
        if blow["non_finite"]:
            what.append("norms that stay NaN/Inf")
        return [e.finding(evidence=[evidence_line(lines, i) for i, _ in hits[:MAX_EVIDENCE]],
                          cause="gradient norm blew up: " + "; ".join(what) + ". " + e.cause,
                          count=len(hits), first_line=hits[0][0] + 1)]
    spikes = grad_norm_spikes(lines)
    if spikes:
        e = kb.entry("grad_norm_spike")
        return [e.finding(evidence=[f"{evidence_line(lines, i)} (norm {v:.4g} vs median {m:.4g})"
                                    for i, v, m in spikes[:MAX_EVIDENCE]],
                          count=len(spikes), first_line=spikes[0][0] + 1)]
    return []


def _hang_findings(lines: list[str], kb: Knowledge) -> list[Finding]:
    s = stuck_collectives(lines)
    if not s:
        return []
    e = kb.entry("pyspy_stuck_collective")
    ops = ", ".join(f"{op} x{n}" for op, n in s["ops"].most_common())
    cause = f"py-spy: {len(s['stuck'])} of {s['dumped']} dumped processes wait in a collective ({ops})"
    if s["others"]:
        odd = "; ".join(f"pid {p['pid']} in {p['frame']}" for p in s["others"][:MAX_EVIDENCE])
        cause += f"; the others are elsewhere ({odd}): they never reached the collective, so look there first"
    ev = [evidence_line(lines, p["line"]) for p in (s["others"] + s["stuck"])[:MAX_EVIDENCE]]
    first = min(p["line"] for p in s["stuck"] + s["others"])
    return [e.finding(evidence=ev, cause=cause + ". " + e.cause, count=len(s["stuck"]), first_line=first + 1,
                      stuck_pids=[p["pid"] for p in s["stuck"]], other_pids=[p["pid"] for p in s["others"]])]


def detector_findings(lines: list[str], kb: Knowledge, production: bool) -> list[Finding]:
    out = _grad_findings(lines, kb) + _hang_findings(lines, kb)
    d = throughput_drop(throughput_series(lines))
    if d:
        e = kb.entry("throughput_drop")
        pct = 100 * (1 - d["recent"] / d["baseline"])
        what = "fell and stayed down" if d["sustained"] else "dipped"
        out.append(e.finding(evidence=[evidence_line(lines, d["line"])],
                             cause=f"throughput {what}: {pct:.0f}% below its earlier median. " + e.cause,
                             first_line=d["line"] + 1, drop_fraction=round(pct / 100, 3)))
    env = env_from_log(lines)
    if env:
        for f in lint_env({k: v for k, (v, _) in env.items()}, production=production):
            if f.severity == "info":
                continue
            i = env[f.extra["variable"]][1]
            f.evidence = [evidence_line(lines, i)]
            f.extra["first_line"] = i + 1
            out.append(f)
    info = nccl_info_lines(lines)
    if len(info) >= 5 and production:
        e = kb.entry("nccl_debug_info_in_production")
        out.append(e.finding(evidence=[evidence_line(lines, i) for i in info[:2]], count=len(info),
                             variable="NCCL_DEBUG", use="NCCL_DEBUG=WARN", first_line=info[0] + 1))
    return out
