"""Global batches of preference pairs, layout-independent like rayspeed.data.batches: a step's global batch is G
pairs drawn by the same seeded schedule ('sequences' are pairs), rank r's micro-batch k the pairs at positions
(k * dp + r) * b .. + b - 1. A micro-batch is (input_ids, labels[, reference logps]): [2b, seq_len] rows, the b
chosen completions then the b rejected ones in the same order, and the reference's [2b] log-probabilities when
they were precomputed (None: a resident reference scores them in the step). The state dict is RankBatches': a
resume under any layout continues the same sequence of pairs."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from rayspeed.data.batches import GlobalBatchSchedule, MicroBatch, RankBatches


def pair_batch(split: Any, positions: np.ndarray, reference: Optional[np.ndarray]) -> MicroBatch:
    ids, labels = split.rows(positions)
    out: MicroBatch = (torch.from_numpy(ids), torch.from_numpy(labels))
    if reference is not None:
        ref = reference[np.asarray(positions, dtype=np.int64)]
        out = (*out, torch.from_numpy(np.concatenate([ref[:, 0], ref[:, 1]]).astype(np.float32)))
    return out


class PairBatches(RankBatches):
    def __init__(self, split: Any, seq_len: int, schedule: GlobalBatchSchedule, dp_rank: int, dp_size: int,
                 micro_batch_size: int, grad_accum: int, start_step: int = 0,
                 reference: Optional[np.ndarray] = None):
        """reference: [pairs, 2] precomputed (chosen, rejected) log-probabilities of the split's pairs."""
        super().__init__(split, seq_len, schedule, dp_rank, dp_size, micro_batch_size, grad_accum, start_step)
        self.reference = reference

    def get(self, step: int) -> list[MicroBatch]:
        return [pair_batch(self.split, idx, self.reference) for idx in self.sequence_indices(step)]


def pair_val_batches(split: Any, batch_size: int, num_batches: int, dp_rank: int, dp_size: int,
                     reference: Optional[np.ndarray] = None) -> list[MicroBatch]:
    """This rank's validation micro-batches of b = batch_size pairs: over num_batches rounds of dp * b held-out
    pairs (capped by the pairs there are; a last partial round is left out, so every rank has the same count)."""
    B = batch_size * dp_size
    rounds = min(num_batches, split.num_pairs // B)
    if rounds < 1:
        raise ValueError(f"the {split.name} split has {split.num_pairs} pairs, fewer than one validation round of "
                         f"{B} (raise data.val_fraction)")
    out = []
    for j in range(rounds):
        first = j * B + dp_rank * batch_size
        out.append(pair_batch(split, np.arange(first, first + batch_size), reference))
    return out
