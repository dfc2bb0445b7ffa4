"""Deterministic global batches, independent of the parallel layout.

The training split is cut into non-overlapping windows of seq_len+1 tokens (a "sequence";
inputs = window[:-1], labels = window[1:]). Global sample g = step * G + i (G = global batch size,
i = position 0..G-1) is sequence perm_e[g % N] with e = g // N and perm_e a PCG64 permutation seeded
from (seed, e). This depends on (N, G, seed) only, never on dp size, micro-batch size or gradient
accumulation, so every layout with the same G trains on the same batches in the same order.

Rank r's micro-batch k (of grad_accum) holds positions (k*dp + r)*b .. (k*dp + r)*b + b-1; over all
ranks and micro-steps that is exactly positions 0..G-1, each once.

A micro-batch is (input_ids, labels) or, with document masking, (input_ids, labels, segment_ids). Labels the loss
must not count (chat: non-assistant tokens; document masking: the first token of a document) are -100. The loss of
a step is then the mean over the counted labels of its whole global batch: `RankBatches.step_tokens(step)` is that
count, the same on every rank and for every layout (computed from the data, no communication).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch

from rayspeed.data.token_split import IGNORE_INDEX, TokenSplit

MicroBatch = tuple[torch.Tensor, ...]


class GlobalBatchSchedule:
    """(step, position) -> sequence index: a seeded permutation of the N sequences per epoch."""

    _CACHED_EPOCHS = 2  # a step spans at most a few epochs; keep the current and the next one

    def __init__(self, num_sequences: int, global_batch_size: int, seed: int, start_step: int = 0,
                 start_sample: int = 0):
        """start_step/start_sample: the global batch size changed at start_step (elastic `playbook` policy),
        after start_sample samples had been consumed; the sample stream continues where it was."""
        if num_sequences < 1:
            raise ValueError(f"num_sequences must be >= 1, got {num_sequences} (corpus too small for seq_len?)")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.num_sequences = int(num_sequences)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.start_step, self.start_sample = int(start_step), int(start_sample)
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            # SeedSequence([seed, epoch]): independent streams per epoch, no seed arithmetic collisions.
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, int(epoch)])))
            perm = rng.permutation(self.num_sequences)
            self._perms[epoch] = perm
            while len(self._perms) > self._CACHED_EPOCHS:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(epoch)
        return perm

    def samples_before(self, step: int) -> int:
        """Samples consumed by steps 0..step-1."""
        return self.start_sample + (step - self.start_step) * self.global_batch_size

    def epoch_of(self, step: int) -> int:
        """Epoch of the first sample of `step`."""
        return self.samples_before(step) // self.num_sequences

    def indices(self, step: int, positions: Optional[Sequence[int]] = None) -> np.ndarray:
        """Sequence indices (int64) for the given positions of step's global batch (default: all G)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        pos = np.arange(self.global_batch_size) if positions is None else np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.global_batch_size):
            raise ValueError(f"positions must be in [0, {self.global_batch_size})")
        g = self.samples_before(step) + pos
        epochs, offsets = np.divmod(g, self.num_sequences)
        out = np.empty(pos.shape, dtype=np.int64)
        for e in np.unique(epochs).tolist():
            sel = epochs == e
            out[sel] = self.permutation(e)[offsets[sel]]
        return out

    def index(self, step: int, position: int) -> int:
        return int(self.indices(step, [position])[0])

    def __repr__(self) -> str:
        return (f"GlobalBatchSchedule(num_sequences={self.num_sequences}, "
                f"global_batch_size={self.global_batch_size}, seed={self.seed})")


def make_schedule(split: TokenSplit, seq_len: int, global_batch_size: int, seed: int) -> GlobalBatchSchedule:
    return GlobalBatchSchedule(split.num_sequences(seq_len), global_batch_size, seed)


def _to_tensors(windows: np.ndarray) -> MicroBatch:
    x = torch.from_numpy(np.ascontiguousarray(windows[:, :-1]))
    y = torch.from_numpy(np.ascontiguousarray(windows[:, 1:]))
    return x, y


class WithImages(tuple):
    """A micro-batch whose windows hold images: the tensors as any other's, `inputs`, what the model's input stage
    takes besides the ids (pixel values, each image's feature rows inside its window), and each image's window."""
    inputs: dict[str, torch.Tensor]
    windows: torch.Tensor


def rows_of(micro_batch: tuple, lo: int, hi: int) -> tuple:
    """Windows [lo, hi) of a micro-batch, with their images."""
    part = tuple(t[lo:hi] for t in micro_batch)
    if not isinstance(micro_batch, WithImages):
        return part
    keep = (micro_batch.windows >= lo) & (micro_batch.windows < hi)
    out = WithImages(part)
    out.inputs = {k: v[keep] for k, v in micro_batch.inputs.items()}
    out.windows = micro_batch.windows[keep] - lo
    return out


def model_inputs(micro_batch: tuple, device: Any) -> dict[str, Any]:
    """The keyword arguments the model takes beside a micro-batch's tensors ({}: a text micro-batch)."""
    inputs = getattr(micro_batch, "inputs", None)
    return {"inputs": {k: v.to(device) for k, v in inputs.items()}} if inputs else {}


def make_batch(split: TokenSplit, seq_indices: np.ndarray, seq_len: int, document_masking: bool = False) -> MicroBatch:
    """(input_ids, labels[, segment_ids]) of the given windows, labels the loss ignores set to -100; with images, a
    WithImages."""
    batch = _text_batch(split, seq_indices, seq_len, document_masking)
    images = getattr(split.store, "images", None)
    if images is None:
        return batch
    pixels, rows, windows = images.window_images(split.window_starts(seq_indices, seq_len), seq_len)
    out = WithImages(batch)
    out.inputs = {"pixel_values": torch.from_numpy(pixels), "image_rows": torch.from_numpy(rows)}
    out.windows = torch.from_numpy(windows)
    return out


def _text_batch(split: TokenSplit, seq_indices: np.ndarray, seq_len: int, document_masking: bool) -> MicroBatch:
    windows = split.windows(seq_indices, seq_len)
    if split.mask is None and not document_masking:
        return _to_tensors(windows)
    labels = windows[:, 1:].copy()
    counted = split.labels_counted(seq_indices, seq_len, document_masking)
    labels[~counted] = IGNORE_INDEX
    out: MicroBatch = (torch.from_numpy(np.ascontiguousarray(windows[:, :-1])), torch.from_numpy(labels))
    if document_masking:
        seg = split.segments(seq_indices, seq_len)[:, :-1]
        out = (*out, torch.from_numpy(np.ascontiguousarray(seg)))
    return out


class RankBatches:
    """One data-parallel rank's micro-batches, step by step; iterable from any start step.

    Iterating yields (step, [(input_ids, labels)] * grad_accum), each LongTensor [b, seq_len].
    state_dict() holds the next step; load it into a RankBatches of ANY layout with the same global
    batch size, seed and data to continue the same global batch sequence.
    """

    def __init__(self, split: TokenSplit, seq_len: int, schedule: GlobalBatchSchedule, dp_rank: int,
                 dp_size: int, micro_batch_size: int, grad_accum: int, start_step: int = 0,
                 document_masking: bool = False, label_counts: Optional[np.ndarray] = None):
        """document_masking: micro-batches carry segment ids and ignore cross-document labels. label_counts: the
        counted labels of every sequence (split.label_counts; computed here when not given)."""
        if min(dp_size, micro_batch_size, grad_accum) < 1:
            raise ValueError(f"dp_size, micro_batch_size and grad_accum must be >= 1, got "
                             f"{dp_size}, {micro_batch_size}, {grad_accum}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
        G = dp_size * micro_batch_size * grad_accum
        if G != schedule.global_batch_size:
            raise ValueError(f"dp_size {dp_size} * micro_batch_size {micro_batch_size} * grad_accum {grad_accum} "
                             f"= {G}, not the global batch size {schedule.global_batch_size}")
        n = split.num_sequences(seq_len)
        if n != schedule.num_sequences:
            raise ValueError(f"schedule has {schedule.num_sequences} sequences but the {split.name} split "
                             f"has {n} of length {seq_len}")
        self.split, self.seq_len, self.schedule = split, int(seq_len), schedule
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.micro_batch_size, self.grad_accum = int(micro_batch_size), int(grad_accum)
        self.step = int(start_step)
        self.document_masking = bool(document_masking)
        self.label_counts = (label_counts if label_counts is not None
                             else split.label_counts(seq_len, self.document_masking))

    @property
    def weighted(self) -> bool:
        """Whether some labels are ignored, so micro-batches count different numbers of tokens."""
        return self.label_counts is not None

    def step_tokens(self, step: int) -> int:
        """Labels the loss counts in step's whole global batch (every rank, every micro-batch)."""
        if self.label_counts is None:
            return self.schedule.global_batch_size * self.seq_len
        return int(self.label_counts[self.schedule.indices(step)].sum())

    def positions(self, micro_step: int) -> np.ndarray:
        """Global-batch positions held by this rank's micro-batch `micro_step`."""
        if not 0 <= micro_step < self.grad_accum:
            raise ValueError(f"micro_step {micro_step} not in [0, {self.grad_accum})")
        first = (micro_step * self.dp_size + self.dp_rank) * self.micro_batch_size
        return np.arange(first, first + self.micro_batch_size)

    def sequence_indices(self, step: int) -> list[np.ndarray]:
        """Per micro-step, the sequence indices this rank reads at `step`."""
        return [self.schedule.indices(step, self.positions(k)) for k in range(self.grad_accum)]

    def get(self, step: int) -> list[MicroBatch]:
        """The grad_accum micro-batches of `step` for this rank (reads only this rank's windows)."""
        return [make_batch(self.split, idx, self.seq_len, self.document_masking) for idx in self.sequence_indices(step)]

    def __iter__(self) -> "RankBatches":
        return self

    def __next__(self) -> tuple[int, list[MicroBatch]]:
        step = self.step
        batches = self.get(step)
        self.step = step + 1  # advanced only once the step's data exists: state_dict = next step to train
        return step, batches

    def iterate(self, start_step: Optional[int] = None,
                num_steps: Optional[int] = None) -> Iterator[tuple[int, list[MicroBatch]]]:
        """Yield (step, micro-batches) from start_step (default: the current position), num_steps of them
        (default: forever)."""
        if start_step is not None:
            self.step = int(start_step)
        done = 0
        while num_steps is None or done < num_steps:
            yield next(self)
            done += 1

    @property
    def epoch(self) -> int:
        return self.schedule.epoch_of(self.step)

    def state_dict(self) -> dict:
        # The layout is recorded for information only: resuming under another layout is allowed.
        return {"step": self.step, "epoch": self.epoch, "seed": self.schedule.seed,
                "consumed_samples": self.schedule.samples_before(self.step),
                "global_batch_size": self.schedule.global_batch_size,
                "num_sequences": self.schedule.num_sequences, "seq_len": self.seq_len,
                "content_hash": self.split.content_hash,
                "layout": {"dp_size": self.dp_size, "micro_batch_size": self.micro_batch_size,
                           "grad_accum": self.grad_accum}}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Continue from state["step"]. strict: the batch sequence must be the same one (seed, global
        batch size, sequences, seq_len, data content), else ValueError."""
        if strict:
            mine = self.state_dict()
            bad = [f"{k}: checkpoint {state.get(k)!r}, now {mine[k]!r}"
                   for k in ("seed", "global_batch_size", "num_sequences", "seq_len")
                   if k in state and state[k] != mine[k]]
            h_old, h_new = state.get("content_hash"), mine["content_hash"]
            if h_old is not None and h_new is not None and h_old != h_new:
                bad.append(f"content_hash: the training data changed ({h_old[:12]} -> {h_new[:12]})")
            if bad:
                raise ValueError("data state does not match this run: " + "; ".join(bad))
        self.step = int(state["step"])

    def __repr__(self) -> str:
        return (f"RankBatches(rank {self.dp_rank}/{self.dp_size}, b={self.micro_batch_size}, "
                f"accum={self.grad_accum}, seq_len={self.seq_len}, step={self.step})")


def val_batches(split: TokenSplit, seq_len: int, batch_size: int, num_batches: int, dp_rank: int,
                dp_size: int, document_masking: bool = False) -> list[MicroBatch]:
    """This rank's validation micro-batches: batch j uses windows j*B + r*b .. +b-1 of the val split
    (b = batch_size per rank, B = b * dp_size), the first num_batches*B windows in all. num_batches is
    capped by the windows available. Same b*dp_size and num_batches => same validation set."""
    if min(batch_size, num_batches, dp_size) < 1:
        raise ValueError("batch_size, num_batches and dp_size must be >= 1, "
                         f"got {batch_size}, {num_batches}, {dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
    B = batch_size * dp_size
    available = split.num_sequences(seq_len) // B
    if available < 1:
        raise ValueError(f"the {split.name} split has {split.num_sequences(seq_len)} sequences of length "
                         f"{seq_len}, fewer than one validation batch of {B} (raise data.val_fraction)")
    out = []
    for j in range(min(num_batches, available)):
        first = j * B + dp_rank * batch_size
        out.append(make_batch(split, np.arange(first, first + batch_size), seq_len, document_masking))
    return out
