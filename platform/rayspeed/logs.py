"""One handler on the "rayspeed" logger: DeepSpeed and Ray reconfigure the root logger as they please."""

from __future__ import annotations

import logging


def setup(prefix: str = "rayspeed") -> logging.Logger:
    root = logging.getLogger("rayspeed")
    for h in list(root.handlers):
        root.removeHandler(h)
    h = logging.StreamHandler()
    h.setFormatter(logging.Formatter(f"[{prefix}] %(message)s"))
    root.addHandler(h)
    root.setLevel(logging.INFO)
    root.propagate = False
    return root
