"""One handler on the "rayspeed" logger (DeepSpeed and Ray reconfigure the root logger as they please), and
`log_rank` for what only one rank should say (nanotron's habit): the rank is recorded once, at setup."""

from __future__ import annotations

import logging
from typing import Any

_rank = 0


def setup(prefix: str = "rayspeed", rank: int = 0) -> logging.Logger:
    global _rank
    _rank = rank
    root = logging.getLogger("rayspeed")
    for h in list(root.handlers):
        root.removeHandler(h)
    h = logging.StreamHandler()
    h.setFormatter(logging.Formatter(f"[{prefix}] %(message)s"))
    root.addHandler(h)
    root.setLevel(logging.INFO)
    root.propagate = False
    return root


def log_rank(logger: logging.Logger, msg: str, *args: Any, rank: int = 0, level: int = logging.INFO) -> None:
    """Log on `rank` only (this process's rank as given to setup)."""
    if _rank == rank:
        logger.log(level, msg, *args)
