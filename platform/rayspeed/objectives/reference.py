"""The reference log-probabilities of a DPO job, computed once before its first step and kept beside the token
cache (train.dpo.reference: precomputed).

The reference is the job's initial weights (model.pretrained, a warm start's train.init_from, or the seeded init;
with an adapter the base, which the adapter equals at step 0). The pass runs right after the engine is built and
before any checkpoint is loaded, so it sees those weights on every attempt; a restart or a retraining cycle on the
same weights and data finds the file and skips it. The file's name is a digest of what decides the numbers: the
reference's identity (the model section, the seed, the initial weights' digests) and the pairs' content.

    key = reference_key(identity, split.content_hash)
    logps = load(cache_dir, key, split.num_pairs)          # [pairs, 2] float64 (chosen, rejected), or None
    logps = compute(score, split.num_pairs, per_call, dp_rank, dp, [dp_group], device)
    save(cache_dir, key, logps)                            # rank 0
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from rayspeed.data.cache import tmp_name

FORMAT = "rayspeed-reference-logps-v1"


def reference_key(identity: dict[str, Any], content_hash: str) -> str:
    return hashlib.sha256(json.dumps([FORMAT, identity, content_hash], sort_keys=True, default=str)
                          .encode()).hexdigest()[:32]


def path_of(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, f"reference-{key}.npy")


def load(cache_dir: str, key: str, num_pairs: int) -> Optional[np.ndarray]:
    try:
        logps = np.load(path_of(cache_dir, key))
    except (OSError, ValueError):
        return None
    return logps if logps.shape == (num_pairs, 2) and np.isfinite(logps).all() else None


def save(cache_dir: str, key: str, logps: np.ndarray) -> str:
    os.makedirs(cache_dir, exist_ok=True)
    final = path_of(cache_dir, key)
    tmp = tmp_name(final)
    try:
        with open(tmp, "wb") as f:
            np.save(f, logps)
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final


@torch.no_grad()
def compute(score: Callable[[list[int]], torch.Tensor], num_pairs: int, per_call: int, dp_rank: int, dp: int,
            groups: Sequence[Any], device: torch.device) -> np.ndarray:
    """[pairs, 2] sequence log-probabilities of a split's chosen and rejected completions: each data-parallel rank
    scores every dp-th run of per_call pairs through score(positions) -> [len(positions), 2], then a sum over
    `groups` (the dp group; under a pipeline also the pp group: only the last stage scores) fills in the rest. The
    ranks of one tensor-parallel group score the same pairs together."""
    out = torch.zeros(num_pairs, 2, dtype=torch.float64, device=device)
    starts = list(range(0, num_pairs, per_call))
    rounds = -(-len(starts) // dp)
    for r in range(rounds):
        # Every rank runs as many forwards (ZeRO-3 gathers each layer's weights over dp): one past the end scores
        # the first pairs again and keeps nothing.
        j = r * dp + dp_rank
        first = starts[j] if j < len(starts) else 0
        positions = list(range(first, min(num_pairs, first + per_call)))
        got = score(positions).double()
        if j < len(starts):
            out[first:first + len(positions)] = got
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(out, group=group)
    return out.cpu().numpy()
