"""Raw .bin token files (today's pre-tokenized form, kept working): little-endian integers with no header, uint16
unless a sidecar `<file>.bin.json` (or `<file>.json`) says {"dtype": "uint32"}. A single file is used in place (the
cache only remembers its hash); a glob of several is concatenated into one cached file, in sorted order. Token
shards with a header (rayspeed.data.shards, `data.source: tokens`) are the documented format for new corpora."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from rayspeed.data.cache import FORMAT_VERSION, cache_key, cached, tmp_name
from rayspeed.errors import ConfigError

_HASH_CHUNK = 1 << 22  # tokens per chunk when hashing a .bin file


def bin_dtype(path: str) -> np.dtype:
    """dtype of a pre-tokenized .bin: from `<file>.bin.json` or `<file>.json` {"dtype": ...}, else uint16."""
    for side in (path + ".json", os.path.splitext(path)[0] + ".json"):
        if os.path.isfile(side):
            with open(side) as f:
                name = json.load(f).get("dtype", "uint16")
            if name not in ("uint16", "uint32"):
                raise ConfigError(f"data.path: {side} says dtype {name!r}; use uint16 or uint32")
            return np.dtype(name).newbyteorder("<")
    return np.dtype("<u2")


def hash_bin(path: str, dtype: np.dtype) -> dict:
    size = os.path.getsize(path)
    if size == 0 or size % dtype.itemsize:
        raise ConfigError(f"data.path: {path} has {size} bytes, not a whole number of {dtype.name} tokens")
    n = size // dtype.itemsize
    mm = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
    h, max_id = hashlib.sha256(), -1
    for a in range(0, n, _HASH_CHUNK):
        chunk = np.asarray(mm[a:a + _HASH_CHUNK])
        h.update(chunk.tobytes())
        max_id = max(max_id, int(chunk.max()))
    del mm
    return {"data_path": path, "dtype": dtype.str, "num_tokens": n, "content_hash": h.hexdigest(),
            "vocab_size": None, "max_token_id": max_id, "num_documents": None}


def check_fits(meta: dict, tok: Any, what: str) -> None:
    if tok is not None and meta["max_token_id"] >= tok.vocab_size:
        raise ConfigError(f"data.tokenizer: {what} holds token id {meta['max_token_id']} but the tokenizer "
                          f"vocabulary has {tok.vocab_size} ids")


def _fitting(meta: dict, tok: Any, what: str) -> dict:
    check_fits(meta, tok, what)  # before the cache records it: bad input leaves nothing written
    return meta


def single_bin(path: str, cache_dir: str, tok: Any = None) -> tuple[str, dict, bool, str]:
    """(real path, meta, built, key) of one .bin used in place, its ids checked against the tokenizer (if any)."""
    real = os.path.realpath(os.path.expanduser(path))
    if not os.path.isfile(real):
        raise ConfigError(f"data.path: no token file at {real!r}")
    dtype = bin_dtype(real)
    st = os.stat(real)
    # The .bin itself is the token file; the cache only remembers its hash (keyed by size+mtime).
    key = cache_key([FORMAT_VERSION, "bin", real, st.st_size, st.st_mtime_ns, dtype.str])
    meta, built = cached(cache_dir, key, lambda _bin_path: _fitting(hash_bin(real, dtype), tok, real))
    check_fits(meta, tok, real)
    return real, meta, built, key


def concatenated_bins(files: list[str], pattern: str, cache_dir: str, tok: Any = None) -> tuple[dict, bool, str]:
    """A glob of .bin token files as one token file in the cache (every file's dtype must agree), its ids checked
    against the tokenizer (if any)."""
    dtypes = {bin_dtype(f).str for f in files}
    if len(dtypes) != 1:
        raise ConfigError(f"data.path: the token files of {pattern!r} have different dtypes ({sorted(dtypes)}); "
                          "re-export them with one dtype")
    dtype = np.dtype(dtypes.pop())

    def build(bin_path: str) -> dict:
        h, n, max_id = hashlib.sha256(), 0, -1
        tmp = tmp_name(bin_path)
        try:
            with open(tmp, "wb") as out:
                for f in files:
                    meta = hash_bin(f, dtype)  # checks the file holds whole tokens
                    mm = np.memmap(f, dtype=dtype, mode="r", shape=(meta["num_tokens"],))
                    for a in range(0, meta["num_tokens"], _HASH_CHUNK):
                        chunk = np.asarray(mm[a:a + _HASH_CHUNK])
                        out.write(chunk.tobytes())
                        h.update(chunk.tobytes())
                    del mm
                    n += meta["num_tokens"]
                    max_id = max(max_id, meta["max_token_id"])
                out.flush()
                os.fsync(out.fileno())
            check_fits({"max_token_id": max_id}, tok, pattern)
            os.replace(tmp, bin_path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return {"data_path": os.path.basename(bin_path), "dtype": dtype.str, "num_tokens": n,
                "content_hash": h.hexdigest(), "vocab_size": None, "max_token_id": max_id, "num_documents": None}

    stats = [[f, os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files]
    key = cache_key([FORMAT_VERSION, "bins", stats, dtype.str])
    meta, built = cached(cache_dir, key, build)
    check_fits(meta, tok, pattern)
    return meta, built, key
