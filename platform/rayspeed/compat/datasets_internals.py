"""Hugging Face `datasets` internals rayspeed uses (written for datasets 5.2); each says why and when it can go."""

from __future__ import annotations

from typing import Any, Optional


def dataset_fingerprint(ds: Any) -> Optional[str]:
    """The fingerprint `datasets` computes for a loaded Dataset (a hash of where it came from and of every transform:
    what its own cache files are named by). Why: the data cache's identity of an `hf` source includes it, so a
    dataset whose content changed under the same name and split (another revision, other data files) is tokenized
    again instead of reusing old shards; `datasets` keeps it only as the private `_fingerprint` (5.2). Remove when
    `datasets` exposes it. If it moves: None (the identity keeps the name, split and length)."""
    return getattr(ds, "_fingerprint", None)
