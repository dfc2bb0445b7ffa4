"""Token shards: rayspeed's binary format for tokenized corpora (what the tokenizer writes into the data cache, and
what `data.source: tokens` reads), and the concatenated read-only view training uses.

A shard file (`.rstok`) holds whole documents. All integers little-endian:

    offset  bytes  field
    0       8      magic b"RSTOKEN1"
    8       4      header size in bytes: 64 (uint32)
    12      4      token width in bytes: 2 (uint16 ids) or 4 (uint32 ids) (uint32)
    16      8      T, the number of tokens (uint64)
    24      8      D, the number of documents (uint64)
    32      4      flags (uint32): bit 0 set = a loss mask follows the document offsets
    36      4      vocabulary size of the tokenizer, 0 if unknown (uint32)
    40      24     reserved, zero
    64      T*w    the token ids, then zero bytes up to a multiple of 8
    ...     8(D+1) document offsets (uint64): document d is tokens [off[d], off[d+1]); off[0] = 0, off[D] = T
    ...     T      only with flag bit 0: the loss mask, one byte per token, 1 = the loss is computed on this
                   token (its prediction counts), 0 = it is context only (chat: every non-assistant token)

The file is exactly that long; anything else is rejected with the file named. Documents carry their own
separators (the tokenizer's EOS, and BOS where the tokenizer adds one): the offsets, not the ids, say where a
document ends, so an EOS inside a chat turn does not split it.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from rayspeed.data.image_shards import ImageTable, write_images
from rayspeed.errors import ConfigError

MAGIC = b"RSTOKEN1"
HEADER_SIZE = 64
FLAG_MASK = 1
SUFFIX = ".rstok"
_HEADER = struct.Struct("<8sIIQQII24x")
_KNOWN_FLAGS = FLAG_MASK


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


class ShardHeader:
    def __init__(self, width: int, num_tokens: int, num_documents: int, has_mask: bool, vocab_size: int = 0):
        self.width, self.num_tokens, self.num_documents = int(width), int(num_tokens), int(num_documents)
        self.has_mask, self.vocab_size = bool(has_mask), int(vocab_size)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype("<u2") if self.width == 2 else np.dtype("<u4")

    @property
    def offsets_at(self) -> int:
        return HEADER_SIZE + _pad8(self.num_tokens * self.width)

    @property
    def mask_at(self) -> int:
        return self.offsets_at + 8 * (self.num_documents + 1)

    @property
    def file_size(self) -> int:
        return self.mask_at + (self.num_tokens if self.has_mask else 0)

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, HEADER_SIZE, self.width, self.num_tokens, self.num_documents,
                            FLAG_MASK if self.has_mask else 0, self.vocab_size)


def read_header(path: str, key: str = "data.path") -> ShardHeader:
    """The header of a shard file, checked against the file's size; ConfigError naming the file otherwise."""
    def bad(why: str) -> ConfigError:
        return ConfigError(f"{key}: {path} is not a rayspeed token shard ({why}); the format is described in "
                           "docs/DATA.md 'Token shards' and rayspeed/data/shards.py")

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path} ({e.strerror or e})") from None
    if len(raw) < HEADER_SIZE:
        raise bad(f"{size} bytes, shorter than the {HEADER_SIZE}-byte header")
    magic, hsize, width, n_tok, n_doc, flags, vocab = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise bad(f"magic {magic!r}, expected {MAGIC!r}")
    if hsize != HEADER_SIZE:
        raise bad(f"header size {hsize}, expected {HEADER_SIZE}")
    if width not in (2, 4):
        raise bad(f"token width {width} bytes, expected 2 or 4")
    if flags & ~_KNOWN_FLAGS:
        raise bad(f"unknown flags {flags:#x}")
    h = ShardHeader(width, n_tok, n_doc, bool(flags & FLAG_MASK), vocab)
    if size != h.file_size:
        raise bad(f"{size} bytes, but its header ({n_tok} tokens, {n_doc} documents"
                  f"{', a loss mask' if h.has_mask else ''}) needs {h.file_size}")
    return h


def write_shard(path: str, tokens: np.ndarray, doc_offsets: Sequence[int], mask: Optional[np.ndarray] = None,
                vocab_size: int = 0, width: Optional[int] = None) -> dict[str, Any]:
    """Write one shard file (to `path` directly: callers write into a temporary folder and commit it).
    Returns {"tokens", "documents", "sha256", "bytes", "max_token_id"}."""
    tokens = np.asarray(tokens)
    offsets = np.asarray(doc_offsets, dtype="<u8")
    if width is None:
        width = 2 if (vocab_size and vocab_size <= 1 << 16) or (tokens.size and int(tokens.max()) < 1 << 16) else 4
    h = ShardHeader(width, tokens.size, offsets.size - 1, mask is not None, vocab_size)
    if offsets.size < 1 or offsets[0] != 0 or int(offsets[-1]) != tokens.size or np.any(np.diff(offsets.astype(
            np.int64)) < 0):
        raise ValueError("document offsets must start at 0, never decrease and end at the number of tokens")
    body = [h.pack(), tokens.astype(h.dtype).tobytes()]
    body.append(b"\0" * (h.offsets_at - HEADER_SIZE - len(body[1])))
    body.append(offsets.tobytes())
    if mask is not None:
        m = np.asarray(mask, dtype=np.uint8)
        if m.shape != tokens.shape:
            raise ValueError("the loss mask must have one byte per token")
        body.append(m.tobytes())
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for part in body:
            f.write(part)
            digest.update(part)
        f.flush()
        os.fsync(f.fileno())
    return {"tokens": int(tokens.size), "documents": int(offsets.size - 1), "sha256": digest.hexdigest(),
            "bytes": sum(len(p) for p in body), "max_token_id": int(tokens.max()) if tokens.size else -1}


class ShardWriter:
    """Collects documents (ids, optional mask) and writes them as one shard."""

    def __init__(self, with_mask: bool, vocab_size: int, images: Optional[dict[str, Any]] = None):
        self.with_mask, self.vocab_size = with_mask, int(vocab_size)
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.offsets = [0]
        self.images_meta = images  # with images: written beside the shard (image_shards.py), this their metadata
        self.pixels: list[np.ndarray] = []
        self.image_at: list[int] = []

    def add(self, ids: Iterable[int], mask: Optional[Iterable[int]] = None,
            images: Sequence[tuple[int, np.ndarray]] = ()) -> None:
        """One document; `images`: (the position of its first placeholder in the document, its uint8 pixels)."""
        a = np.asarray(ids, dtype=np.int64)
        self.ids.append(a)
        if self.with_mask:
            self.masks.append(np.asarray(mask, dtype=np.uint8) if mask is not None else np.ones(a.size, np.uint8))
        for at, pixels in images:
            self.image_at.append(self.offsets[-1] + int(at))
            self.pixels.append(pixels)
        self.offsets.append(self.offsets[-1] + a.size)

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    def write(self, path: str) -> dict[str, Any]:
        tokens = np.concatenate(self.ids) if self.ids else np.zeros(0, np.int64)
        mask = (np.concatenate(self.masks) if self.masks else np.zeros(0, np.uint8)) if self.with_mask else None
        width = 2 if self.vocab_size <= 1 << 16 else 4
        entry = write_shard(path, tokens, self.offsets, mask, self.vocab_size, width)
        if self.images_meta is not None:
            entry.update(write_images(path, self.pixels, self.image_at, self.images_meta))
        return entry


class Shard:
    """One shard file, memory-mapped read-only."""

    def __init__(self, path: str, header: Optional[ShardHeader] = None):
        self.path = path
        self.header = header or read_header(path)
        h = self.header
        self.tokens = np.memmap(path, dtype=h.dtype, mode="r", offset=HEADER_SIZE, shape=(h.num_tokens,)) \
            if h.num_tokens else np.zeros(0, h.dtype)
        self.offsets = np.fromfile(path, dtype="<u8", count=h.num_documents + 1, offset=h.offsets_at).astype(np.int64)
        self.mask = (np.memmap(path, dtype=np.uint8, mode="r", offset=h.mask_at, shape=(h.num_tokens,))
                     if h.has_mask and h.num_tokens else None)


class Concat:
    """Several 1-D arrays as one, read by slices: len(), [a:b], [i], np.asarray() (small ones), tolist()."""

    def __init__(self, parts: list[Any]):
        self.parts = parts
        self.starts = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
        self.dtype = parts[0].dtype if parts else np.dtype("<u2")

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            a, b, step = key.indices(len(self))
            if step != 1:
                raise IndexError("only contiguous slices")
            if b <= a:
                return np.zeros(0, self.dtype)
            i = int(np.searchsorted(self.starts, a, side="right")) - 1
            out = []
            while a < b:
                lo = a - int(self.starts[i])
                take = min(b - a, len(self.parts[i]) - lo)
                out.append(np.asarray(self.parts[i][lo:lo + take]))
                a += take
                i += 1
            return out[0] if len(out) == 1 else np.concatenate(out)
        i = int(key) + (len(self) if int(key) < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(key)
        j = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.parts[j][i - int(self.starts[j])]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self[0:len(self)]
        return a if dtype is None else a.astype(dtype)

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()


class ShardSet:
    """The shards of one corpus in order: tokens, loss mask (or None) and global document starts."""

    def __init__(self, paths: list[str]):
        self.paths = list(paths)
        self._open()

    def _open(self) -> None:
        shards = [Shard(p) for p in self.paths]
        nonempty = [s for s in shards if s.header.num_tokens]
        self.tokens = Concat([s.tokens for s in nonempty])
        masks = [s.mask for s in nonempty]
        self.has_mask = bool(nonempty) and all(m is not None for m in masks)
        if any(m is not None for m in masks) and not self.has_mask:
            raise ConfigError(f"data.path: some shards of {os.path.dirname(self.paths[0])} carry a loss mask and "
                              "some do not; write them all with or all without one")
        self.mask = Concat(masks) if self.has_mask else None
        base, starts = 0, []
        for s in shards:
            starts.append(s.offsets[:-1] + base)
            base += s.header.num_tokens
        self.doc_starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        bases = np.cumsum([0] + [s.header.num_tokens for s in shards])[:-1].tolist()
        self.images = ImageTable.open(self.paths, bases)  # None: a text corpus
        self.num_documents = int(self.doc_starts.size)
        self.vocab_size = max((s.header.vocab_size for s in shards), default=0)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getstate__(self) -> dict:
        return {"paths": self.paths}  # reopened by name in the process that unpickles it

    def __setstate__(self, state: dict) -> None:
        self.paths = state["paths"]
        self._open()
