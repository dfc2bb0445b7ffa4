"""One handler on the "rayspeed" logger (DeepSpeed and Ray reconfigure the root logger as they please), and
`log_rank` for what only one rank should say (nanotron's habit): the rank is recorded once, at setup. Every line
the handler writes (tracebacks included) goes through rayspeed.redact: credentials in URIs, secret-named
NAME=value pairs and the values of secret-named environment variables never reach the log."""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from rayspeed.redact import redact_text

_rank = 0


class RedactingFormatter(logging.Formatter):
    """A Formatter whose output (message, arguments and exception text) has every secret masked."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))


def setup(prefix: str = "rayspeed", rank: int = 0) -> logging.Logger:
    global _rank
    _rank = rank
    root = logging.getLogger("rayspeed")
    for h in list(root.handlers):
        root.removeHandler(h)
    h = logging.StreamHandler()
    h.setFormatter(RedactingFormatter(f"[{prefix}] %(message)s"))
    root.addHandler(h)
    root.setLevel(logging.INFO)
    root.propagate = False
    return root


def log_rank(logger: logging.Logger, msg: str, *args: Any, rank: int = 0, level: int = logging.INFO) -> None:
    """Log on `rank` only (this process's rank as given to setup)."""
    if _rank == rank:
        logger.log(level, msg, *args)


VERBOSE_ENV = "RAYSPEED_VERBOSE"


@dataclass(frozen=True)
class Benign:
    """A line a library prints on every run that says nothing a user acts on. Silenced only where it is known to
    be benign (`cpu_only`: an accelerator warning that matters on a GPU job); `--verbose` shows them all."""

    pattern: str
    why: str
    logger: str = ""
    """The exact logger that emits it (a filter acts on the emitting logger's own records); a name with a "/" is a
    logger named after its file (logging.getLogger(__file__)), matched by its end on the root logger's handlers."""
    warning: type[Warning] | None = None
    """Or a Python warning of this category whose message matches."""
    cpu_only: bool = False


# The one list. Nothing the doctor diagnoses from (NCCL, CUDA, Ray's node and worker failures) is on it.
BENIGN = (
    Benign(r"Setting accelerator to CPU", "DeepSpeed's accelerator detection on a CPU job: CPU is what was asked for",
           logger="DeepSpeed", cpu_only=True),
    Benign(r"^Reporting training result \d+", "Ray Train echoes every ray.train.report call (one per checkpoint)",
           logger="ray/train/v2/_internal/execution/context.py"),
    Benign(r"^Progress bars disabled", "Ray Data says rayspeed turned its bars off (rayspeed reports progress)",
           logger="ray.data._internal.progress"),
    Benign(r"Unable to find license information|model card could not be retrieved",
           "MLflow looks for a hub model card of a locally trained model; rayspeed writes the LICENSE note itself",
           logger="mlflow.transformers"),
    Benign(r"^Registered model '.*' already exists\. Creating a new version",
           "rayspeed creates the registered model (with its description) before MLflow registers the version",
           logger="mlflow.tracking._model_registry.fluent"),
    Benign(r"You are using ZeRO with an untested optimizer", "DeepSpeed names its own optimizers 'tested'; rayspeed "
           "hands ZeRO torch's AdamW, whose steps the parity tests compare with torch's", logger="DeepSpeed"),
    Benign(r"^generated new fontManager", "matplotlib builds its font cache once per home folder (the run's charts)",
           logger="matplotlib.font_manager"),
    Benign(r"Failed to load CPU gemm_4bit_forward from kernels-community",
           "bitsandbytes, imported by peft and transformers in any job, looks for an optional CPU kernel package; "
           "NF4 on the CPU computes without it", logger="bitsandbytes.backends.cpu.ops"),
    Benign(r"torch\.distributed\.all_gather_into_tensor. is deprecated|torch\.distributed\.reduce_scatter_tensor. is "
           r"deprecated", "DeepSpeed calls collectives torch renamed; the calls work", warning=FutureWarning),
)


class _Drop(logging.Filter):
    def __init__(self, rx: re.Pattern[str], name_suffix: str = ""):
        super().__init__()
        self.rx, self.name_suffix = rx, name_suffix

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or (self.name_suffix and not record.name.endswith(self.name_suffix)):
            return True  # an error is never benign
        try:
            return not self.rx.search(record.getMessage())
        except Exception:
            return True


def _add_once(target: Any, f: _Drop) -> None:
    if not any(isinstance(g, _Drop) and (g.rx.pattern, g.name_suffix) == (f.rx.pattern, f.name_suffix)
               for g in target.filters):
        target.addFilter(f)


def plain_unless_terminal() -> None:
    """Ray prefixes the workers' lines it echoes with colour codes, which a log file or `ray job logs` shows as
    `[36m`: none unless stderr is a terminal (an operator's RAY_COLOR_PREFIX wins). Before Ray starts or joins."""
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def quiet_benign(use_gpu: bool, verbose: bool | None = None) -> int:
    """Silence BENIGN in this process (call it before the libraries are imported: their loggers keep the filter).
    Returns how many entries apply; none with --verbose (RAYSPEED_VERBOSE=1)."""
    if verbose is None:
        verbose = os.environ.get(VERBOSE_ENV, "") not in ("", "0")
    if verbose:
        return 0
    n = 0
    for b in BENIGN:
        if b.cpu_only and use_gpu:
            continue
        if b.logger and "/" in b.logger:
            for h in logging.getLogger().handlers:  # the handlers the library's record propagates to
                _add_once(h, _Drop(re.compile(b.pattern), b.logger))
        elif b.logger:
            _add_once(logging.getLogger(b.logger), _Drop(re.compile(b.pattern)))
        if b.warning is not None:
            warnings.filterwarnings("ignore", message=f".*(?:{b.pattern})", category=b.warning)
        n += 1
    # Progress bars of weight loading and hub downloads: a log is not a terminal.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    return n
