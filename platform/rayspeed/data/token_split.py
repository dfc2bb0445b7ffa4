"""A range of a token stream cut into training windows, with what the loss and the attention need besides the ids:
the loss mask (chat: assistant tokens only) and the document boundaries (document masking).

Window j of a split is tokens [start + j*(s+1), start + (j+1)*(s+1)): inputs are its first s tokens, labels its
last s. Label t (the prediction of token t+1 of the window) is ignored (-100) when token t+1 has loss mask 0, and,
with document masking, when token t+1 starts a document (the first token of a document is never predicted from
the previous one). Segment ids give each input position its document, so attention stays within a document.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence, Union

import numpy as np

from rayspeed.errors import ConfigError

IGNORE_INDEX = -100
_COUNT_CHUNK = 1 << 16  # windows per chunk when counting labels


def _open_memmap(path: str, dtype: Any, num_tokens: int) -> np.memmap:
    return np.memmap(path, dtype=np.dtype(dtype), mode="r", shape=(num_tokens,))


class TokenSplit:
    """A contiguous range [start, stop) of a token stream, cut into windows of seq_len+1 tokens.

    `tokens` is any 1-D indexable (a memmap, or a shards.Concat over shard files); windows are read one contiguous
    slice at a time, so only the requested windows are ever touched. `mask` (same length, uint8, or None: every
    token counts) and `doc_starts` (sorted global positions where documents start, or None: unknown) come with it.
    `store`: what pickles instead of the arrays (a ShardSet), or None.
    """

    def __init__(self, tokens: Any, start: int = 0, stop: Optional[int] = None, name: str = "train",
                 content_hash: Optional[str] = None, mask: Any = None, doc_starts: Optional[np.ndarray] = None,
                 store: Any = None):
        total = len(tokens)
        stop = total if stop is None else stop
        if not 0 <= start <= stop <= total:
            raise ValueError(f"bad split range [{start}, {stop}) of {total} tokens")
        self.tokens, self.mask, self.doc_starts, self.store = tokens, mask, doc_starts, store
        self.start, self.stop = int(start), int(stop)
        self.name = name
        self.content_hash = content_hash

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start

    def __len__(self) -> int:
        return self.num_tokens

    def num_sequences(self, seq_len: int) -> int:
        """Non-overlapping windows of seq_len+1 tokens (the tail that does not fill one is unused)."""
        return self.num_tokens // (seq_len + 1)

    def _starts(self, seq_indices: Sequence[int], seq_len: int) -> list[int]:
        idx = np.asarray(seq_indices, dtype=np.int64).reshape(-1)
        n, w = self.num_sequences(seq_len), seq_len + 1
        out = []
        for j in idx.tolist():
            if not 0 <= j < n:
                raise IndexError(f"sequence {j} out of range: {self.name} split has {n} of length {seq_len}")
            out.append(self.start + j * w)
        return out

    def window_starts(self, seq_indices: Sequence[int], seq_len: int) -> list[int]:
        """The global token position where each window starts."""
        return self._starts(seq_indices, seq_len)

    def _read(self, arr: Any, seq_indices: Sequence[int], seq_len: int, dtype: Any) -> np.ndarray:
        starts, w = self._starts(seq_indices, seq_len), seq_len + 1
        out = np.empty((len(starts), w), dtype=dtype)
        for row, a in enumerate(starts):
            out[row] = np.asarray(arr[a:a + w])
        return out

    def windows(self, seq_indices: Sequence[int], seq_len: int) -> np.ndarray:
        """int64 array [len(seq_indices), seq_len+1]: window j = tokens[j*(seq_len+1) : (j+1)*(seq_len+1)]."""
        return self._read(self.tokens, seq_indices, seq_len, np.int64)

    @property
    def has_documents(self) -> bool:
        return self.doc_starts is not None

    def segments(self, seq_indices: Sequence[int], seq_len: int) -> np.ndarray:
        """int64 [n, seq_len+1]: the document index of every token of each window (equal ids = same document)."""
        if self.doc_starts is None:
            raise ConfigError("data.document_masking: this corpus records no document boundaries")
        pos = np.asarray(self._starts(seq_indices, seq_len), dtype=np.int64)[:, None] + np.arange(seq_len + 1)
        return np.searchsorted(self.doc_starts, pos, side="right").astype(np.int64)

    def labels_counted(self, seq_indices: Sequence[int], seq_len: int, document_masking: bool) -> Optional[np.ndarray]:
        """bool [n, seq_len]: which labels count (None: all of them)."""
        counted = None
        if self.mask is not None:
            counted = self._read(self.mask, seq_indices, seq_len, np.uint8)[:, 1:].astype(bool)
        if document_masking:
            seg = self.segments(seq_indices, seq_len)
            same = seg[:, 1:] == seg[:, :-1]
            counted = same if counted is None else counted & same
        return counted

    def label_counts(self, seq_len: int, document_masking: bool) -> Optional[np.ndarray]:
        """int64 [num_sequences]: counted labels of every window (None: all seq_len of them, in every window). What
        the loss of a step is normalised by: the counted labels of its global batch."""
        if self.mask is None and not document_masking:
            return None
        n = self.num_sequences(seq_len)
        if self.mask is None:  # document masking alone: seq_len minus the documents starting inside each window
            if self.doc_starts is None:
                raise ConfigError("data.document_masking: this corpus records no document boundaries")
            a = self.start + np.arange(n, dtype=np.int64) * (seq_len + 1)
            inside = (np.searchsorted(self.doc_starts, a + seq_len, side="right")
                      - np.searchsorted(self.doc_starts, a, side="right"))
            return seq_len - inside.astype(np.int64)
        out = np.empty(n, dtype=np.int64)
        for a in range(0, n, _COUNT_CHUNK):
            idx = np.arange(a, min(n, a + _COUNT_CHUNK))
            out[a:a + idx.size] = self.labels_counted(idx, seq_len, document_masking).sum(axis=1)
        return out

    # A memmap pickles as its full contents; ship the file name (or the shard list) instead (Ray workers, spawn).
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self.store is not None:
            state["tokens"] = state["mask"] = None
            return state
        t = self.tokens
        if isinstance(t, np.memmap) and getattr(t, "filename", None) and t.offset == 0:
            state["tokens"] = ("__memmap__", os.fspath(t.filename), t.dtype.str, len(t))
        return state

    def __setstate__(self, state: dict) -> None:
        t = state["tokens"]
        if state.get("store") is not None:
            state["tokens"], state["mask"] = state["store"].tokens, state["store"].mask
        elif isinstance(t, tuple) and t and t[0] == "__memmap__":
            state["tokens"] = _open_memmap(t[1], t[2], t[3])
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"TokenSplit({self.name}, tokens [{self.start}, {self.stop}))"


def split_train_val(token_file: Union[Any, TokenSplit], val_fraction: float,
                    seq_len: int) -> tuple[TokenSplit, TokenSplit]:
    """(train, val): the last val_fraction of the stream is validation, at least one window of
    seq_len+1 tokens when val_fraction > 0 (val_fraction 0: empty val)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: must be in [0, 1), got {val_fraction}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    whole = token_file if isinstance(token_file, TokenSplit) else token_file.whole()
    base, n = whole.start, whole.num_tokens
    w = seq_len + 1
    n_val = 0 if val_fraction == 0 else max(w, int(n * val_fraction))
    if n - n_val < w:
        raise ConfigError(f"data: the corpus has {n} tokens, too few for a training window of {w} "
                          f"tokens plus {n_val} validation tokens (seq_len {seq_len}, val_fraction {val_fraction})")
    cut = base + n - n_val
    extra = dict(content_hash=whole.content_hash, mask=whole.mask, doc_starts=whole.doc_starts, store=whole.store)
    return (TokenSplit(whole.tokens, base, cut, "train", **extra),
            TokenSplit(whole.tokens, cut, base + n, "val", **extra))
