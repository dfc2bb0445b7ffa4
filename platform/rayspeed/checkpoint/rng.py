"""Random-number state of one rank: seeded at start, saved beside its checkpoint shard, restored on an exact
resume (same world size; after a resize the seed stream cannot continue rank by rank anyway)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def file_name(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def state() -> dict[str, Any]:
    """Every generator's state as tensors, ints and strings only: what `torch.load(weights_only=True)` accepts
    (the file is read without unpickling arbitrary objects)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    s: dict[str, Any] = {
        "python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_state(s: dict[str, Any]) -> None:
    p, n = s["python"], s["numpy"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss"]))
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save(folder: Path, rank: int, s: dict[str, Any] | None = None) -> Path:
    """This rank's generators (or the state `s` taken earlier: an asynchronous save writes its snapshot's)."""
    path = Path(folder) / file_name(rank)
    torch.save(state() if s is None else s, path)
    return path


def load(folder: Path, rank: int) -> bool:
    """Restore this rank's state from folder; False when the file is not there."""
    path = Path(folder) / file_name(rank)
    if not path.exists():
        return False
    set_state(torch.load(path, weights_only=True))
    return True
