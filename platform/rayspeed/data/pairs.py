"""Preference pairs, tokenized once into the data cache: the records of a files or hf source (TRL's three forms,
rayspeed.data.preference) -> each pair's prompt, chosen and rejected ids, stored flat beside the token shards.

    pairs = build_pairs(spec, cache_dir, tokenizer)        # PairFile (a cache hit after the launcher built it)
    train, val = pairs.split(val_fraction, seq_len)         # PairSplits
    ids, labels = train.rows([0, 3], seq_len)               # [2b, seq_len] each: the chosen rows, then the rejected

A row is the prompt and one completion cut to seq_len + 1 tokens from the start (TRL's max_length = seq_len + 1 with
its keep_start truncation: the last token is only a label), right-padded; the model reads its first seq_len tokens
and the labels are the next tokens over the completion (-100 over the prompt and the padding). A pair whose prompt
alone fills the row has nothing to score and is left out, as TRL drops it; the count is logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any, Optional, Sequence

import numpy as np

from rayspeed.data.cache import atomic_write_json, building, cache_key, note_written, tmp_name
from rayspeed.data.chat import TemplateRoles
from rayspeed.data.preference import PairIds, tokenize_pair
from rayspeed.data.records import DataSpec, describe, iter_records, plan_units
from rayspeed.data.token_split import IGNORE_INDEX
from rayspeed.errors import ConfigError

log = logging.getLogger("rayspeed")

PAIRS_FORMAT = "rayspeed-pairs-v1"


class PairFile:
    """Every pair of a source: tokens (int32, flat) and spans [n, 4] (offset, prompt, chosen, rejected lengths)."""

    def __init__(self, tokens: np.ndarray, spans: np.ndarray, source: str, content_hash: str, pad_id: int):
        self.tokens, self.spans, self.source, self.pad_id = tokens, spans, source, int(pad_id)
        self.content_hash = content_hash

    def __len__(self) -> int:
        return int(self.spans.shape[0])

    def pair(self, i: int) -> PairIds:
        off, p, c, r = (int(v) for v in self.spans[i])
        t = self.tokens
        return PairIds(t[off:off + p].tolist(), t[off + p:off + p + c].tolist(),
                       t[off + p + c:off + p + c + r].tolist())

    def usable(self, seq_len: int) -> np.ndarray:
        """Indices of the pairs with a completion token inside a row of seq_len + 1 tokens."""
        return np.flatnonzero(self.spans[:, 1] < seq_len + 1)

    def split(self, val_fraction: float, seq_len: int) -> tuple["PairSplit", "PairSplit"]:
        """(train, val): the tail val_fraction of the usable pairs is held out (at least one pair each)."""
        keep = self.usable(seq_len)
        n_val = max(1, int(round(len(keep) * val_fraction)))
        if len(keep) - n_val < 1:
            raise ConfigError(f"data: {self.source} has {len(keep)} usable preference pairs at model.seq_len "
                              f"{seq_len}, too few to hold out data.val_fraction {val_fraction} and train on the rest")
        return PairSplit(self, keep[:-n_val], "train", seq_len), PairSplit(self, keep[-n_val:], "val", seq_len)

    def whole(self, name: str, seq_len: int) -> "PairSplit":
        return PairSplit(self, self.usable(seq_len), name, seq_len)

    def __repr__(self) -> str:
        return f"PairFile({self.source}: {len(self)} pairs, {self.tokens.size} tokens)"


class PairSplit:
    """Some pairs of a PairFile, in order, at one seq_len: what a schedule draws from ('sequences' are pairs)."""

    def __init__(self, file: PairFile, indices: np.ndarray, name: str, seq_len: int):
        self.file, self.indices, self.name, self.seq_len = file, np.asarray(indices, dtype=np.int64), name, seq_len
        dropped = len(file) - len(file.usable(seq_len))
        self.dropped = dropped
        self.content_hash = hashlib.sha256(f"{file.content_hash}:{name}:{seq_len}:{self.indices[:1].tolist()}:"
                                           f"{len(self.indices)}".encode()).hexdigest()

    @property
    def num_pairs(self) -> int:
        return int(self.indices.size)

    def num_sequences(self, seq_len: int) -> int:  # the schedule's N (rayspeed.data.batches)
        return self.num_pairs

    def label_counts(self, seq_len: int, document_masking: bool = False) -> None:
        return None  # a DPO loss is a mean over pairs: no per-label weighting

    def rows(self, positions: Sequence[int], seq_len: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
        """(input ids, labels), both [2b, seq_len] int64, of the split's pairs at `positions`: chosen rows first."""
        s = self.seq_len if seq_len is None else seq_len
        pairs = [self.file.pair(int(self.indices[i])) for i in positions]
        width = s + 1
        rows = [(p.prompt, p.chosen) for p in pairs] + [(p.prompt, p.rejected) for p in pairs]
        ids = np.full((len(rows), width), self.file.pad_id, dtype=np.int64)
        counted = np.zeros((len(rows), width), dtype=bool)
        for i, (prompt, completion) in enumerate(rows):
            seq = (prompt + completion)[:width]
            ids[i, :len(seq)] = seq
            counted[i, len(prompt):len(seq)] = True
        labels = np.where(counted[:, 1:], ids[:, 1:], IGNORE_INDEX)
        return ids[:, :-1], labels

    def __repr__(self) -> str:
        return f"{self.file.source} [{self.name}: {self.num_pairs} pairs]"


def _pad_id(tokenizer: Any) -> int:
    hf = getattr(tokenizer, "hf", None)
    for v in (getattr(hf, "pad_token_id", None), getattr(tokenizer, "eos_id", None)):
        if v is not None:
            return int(v)
    return 0  # padding is never attended to by a counted token nor counted itself: any id will do


def _tokenize_all(spec: DataSpec, units: list[Any], tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    chunks: list[np.ndarray] = []
    spans: list[tuple[int, int, int, int]] = []
    off = 0
    hf = getattr(tokenizer, "hf", None)
    roles = TemplateRoles(hf, repr(tokenizer), key="train.objective dpo") if hf is not None else None
    for unit in units:
        for record, loc in iter_records(unit, spec):
            p = tokenize_pair(record, tokenizer, where=describe(loc), data_format=spec.format, roles=roles)
            if not p.chosen or not p.rejected:
                raise ConfigError(f"train.objective dpo: {describe(loc)}: an empty chosen or rejected completion")
            chunks.append(np.asarray(p.prompt + p.chosen + p.rejected, dtype=np.int32))
            spans.append((off, len(p.prompt), len(p.chosen), len(p.rejected)))
            off += chunks[-1].size
    if not spans:
        raise ConfigError(f"data.path: {spec.describe()} holds no preference records")
    return np.concatenate(chunks), np.asarray(spans, dtype=np.int64)


def build_pairs(spec: DataSpec, cache_dir: str, tokenizer: Any) -> PairFile:
    """The source's pairs from the cache, tokenized now (inline, under the cache's lock) when it lacks them."""
    units, ident = plan_units(spec)
    # data.format: chat in the key only: it refuses string records that text accepts, and text's keys stay as they were.
    key = cache_key([PAIRS_FORMAT, spec.source, ident, spec.split, tokenizer.fingerprint]
                    + (["chat"] if spec.format == "chat" else []))
    stem = os.path.join(cache_dir, f"pairs-{key}")
    found = _read(stem)
    if found is not None:
        return found
    with building(cache_dir, f"pairs-{key}"):  # a bad record leaves nothing behind: no lock file, no folder
        found = _read(stem)
        if found is not None:
            return found
        t0 = time.monotonic()
        tokens, spans = _tokenize_all(spec, units, tokenizer)
        tmp = tmp_name(stem + ".npz")
        try:
            with open(tmp, "wb") as f:
                np.savez(f, tokens=tokens, spans=spans)
            os.replace(tmp, stem + ".npz")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        digest = hashlib.sha256(tokens.tobytes() + spans.tobytes()).hexdigest()
        atomic_write_json(stem + ".json", {"format": PAIRS_FORMAT, "key": key, "source": spec.describe(),
                                           "identity": ident, "tokenizer": tokenizer.fingerprint,
                                           "pairs": int(spans.shape[0]), "tokens": int(tokens.size),
                                           "content_hash": digest, "pad_id": _pad_id(tokenizer)})
        note_written("entry", stem + ".json", stem + ".npz")
        log.info("tokenized %s: %d preference pairs, %d tokens (%.1f s)", spec.describe(), spans.shape[0],
                 tokens.size, time.monotonic() - t0)
    found = _read(stem)
    if found is None:
        raise RuntimeError(f"preference cache entry {stem}.json is inconsistent right after writing it")
    return found


def _read(stem: str) -> Optional[PairFile]:
    try:
        with open(stem + ".json") as f:
            meta = json.load(f)
        if meta.get("format") != PAIRS_FORMAT:
            return None
        with np.load(stem + ".npz") as z:
            tokens, spans = z["tokens"], z["spans"]
    except (OSError, ValueError, KeyError):
        return None
    if spans.shape[0] != meta["pairs"] or tokens.size != meta["tokens"]:
        return None
    return PairFile(tokens, spans, meta["source"], meta["content_hash"], meta["pad_id"])
