"""One handler on the "rayspeed" logger (DeepSpeed and Ray reconfigure the root logger as they please), and
`log_rank` for what only one rank should say (nanotron's habit): the rank is recorded once, at setup. Every line
the handler writes (tracebacks included) goes through rayspeed.redact: credentials in URIs, secret-named
NAME=value pairs and the values of secret-named environment variables never reach the log."""

from __future__ import annotations

import logging
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
