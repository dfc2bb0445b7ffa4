"""Corpora tokenized once into a cached, memory-mapped token file, and their train/val split.

Sources:
  python-stdlib  the .py files of the running Python's standard library (no site-packages, no
                 test folders: ~12 MB of text, built in about a second). The demo corpus.
  files          the text files matched by `path` (a glob, `**` allowed).
  .bin           `path` ends in .bin (source "files" or "bin"): a pre-tokenized token file.

Token files (cached or .bin) are raw little-endian integers with no header: uint16 unless a
sidecar `<file>.bin.json` (or `<file>.json`) says {"dtype": "uint32"}. The builder writes uint16
when the vocabulary fits (<= 65536 ids), else uint32. Documents are separated by the tokenizer's
eos_id (byte 0 for the byte tokenizer), also after the last one.

Cache: <cache_dir>/tokens-<key>.bin + .json (meta), key = hash of (format version, source, sorted
file list with sizes and mtimes, tokenizer fingerprint). Several processes on one machine may call
build_token_file at once: an fcntl lock lets one build while the others wait, then reuse; files are
written to a temp name in the same folder and os.replace'd, and the meta file, written last, is the
commit marker. (flock is per machine: on a shared filesystem each node builds under its own lock,
which is still safe because of the atomic rename, just redundant.)
"""

from __future__ import annotations

import fcntl
import glob as _glob
import hashlib
import json
import os
import secrets
import sysconfig
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np

from rayspeed.data.tokenizer import encode_array, load_tokenizer
from rayspeed.errors import ConfigError

FORMAT_VERSION = "rayspeed-tokens-v1"
SOURCES = ("python-stdlib", "files", "bin")
# Folders left out of the stdlib corpus: installed packages, bytecode, and the (large) test suites.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_HASH_CHUNK = 1 << 22  # tokens per chunk when hashing a .bin file


def default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "rayspeed", "data")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id (0..vocab_size-1) fits, else uint32; always little-endian."""
    if vocab_size <= 1 << 16:
        return np.dtype("<u2")
    if vocab_size <= 1 << 32:
        return np.dtype("<u4")
    raise ConfigError(f"data.tokenizer: vocab_size {vocab_size} does not fit in uint32")


def _open_memmap(path: str, dtype: Any, num_tokens: int) -> np.memmap:
    return np.memmap(path, dtype=np.dtype(dtype), mode="r", shape=(num_tokens,))


class TokenSplit:
    """A contiguous range [start, stop) of a token stream, cut into windows of seq_len+1 tokens.

    `tokens` is any 1-D indexable (normally the TokenFile memmap); windows are read one contiguous
    slice at a time, so only the requested windows are ever touched.
    """

    def __init__(self, tokens: Any, start: int = 0, stop: Optional[int] = None, name: str = "train",
                 content_hash: Optional[str] = None):
        total = len(tokens)
        stop = total if stop is None else stop
        if not 0 <= start <= stop <= total:
            raise ValueError(f"bad split range [{start}, {stop}) of {total} tokens")
        self.tokens = tokens
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

    def windows(self, seq_indices: Sequence[int], seq_len: int) -> np.ndarray:
        """int64 array [len(seq_indices), seq_len+1]: window j = tokens[j*(seq_len+1) : (j+1)*(seq_len+1)]."""
        idx = np.asarray(seq_indices, dtype=np.int64).reshape(-1)
        n, w = self.num_sequences(seq_len), seq_len + 1
        out = np.empty((idx.size, w), dtype=np.int64)
        for row, j in enumerate(idx.tolist()):
            if not 0 <= j < n:
                raise IndexError(f"sequence {j} out of range: {self.name} split has {n} of length {seq_len}")
            a = self.start + j * w
            out[row] = np.asarray(self.tokens[a:a + w])
        return out

    # A memmap pickles as its full contents; ship the file name instead (Ray workers, spawn).
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        t = self.tokens
        if isinstance(t, np.memmap) and getattr(t, "filename", None) and t.offset == 0:
            state["tokens"] = ("__memmap__", os.fspath(t.filename), t.dtype.str, len(t))
        return state

    def __setstate__(self, state: dict) -> None:
        t = state["tokens"]
        if isinstance(t, tuple) and t and t[0] == "__memmap__":
            state["tokens"] = _open_memmap(t[1], t[2], t[3])
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"TokenSplit({self.name}, tokens [{self.start}, {self.stop}))"


class TokenFile:
    """A read-only memory-mapped token stream plus what identifies it.

    built: whether this call tokenized (or, for .bin, hashed) it rather than reusing the cache.
    content_hash: sha256 of the stored token bytes; a change means "the data changed".
    """

    def __init__(self, path: str, dtype: Any, num_tokens: int, content_hash: str, source: str,
                 vocab_size: Optional[int] = None, max_token_id: Optional[int] = None,
                 num_documents: Optional[int] = None, built: bool = False, cache_key: Optional[str] = None):
        self.path = path
        self.dtype = np.dtype(dtype)
        self.num_tokens = int(num_tokens)
        self.content_hash = content_hash
        self.source = source
        self.vocab_size = vocab_size
        self.max_token_id = max_token_id
        self.num_documents = num_documents
        self.built = built
        self.cache_key = cache_key
        self.tokens = _open_memmap(path, self.dtype, self.num_tokens)

    def split(self, val_fraction: float, seq_len: int) -> tuple[TokenSplit, TokenSplit]:
        return split_train_val(self, val_fraction, seq_len)

    def __len__(self) -> int:
        return self.num_tokens

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["tokens"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.tokens = _open_memmap(self.path, self.dtype, self.num_tokens)

    def __repr__(self) -> str:
        return (f"TokenFile({self.source}, {self.num_tokens} tokens, {self.dtype.name}, "
                f"sha256 {self.content_hash[:12]}, {self.path})")


def split_train_val(token_file: Union[TokenFile, TokenSplit], val_fraction: float,
                    seq_len: int) -> tuple[TokenSplit, TokenSplit]:
    """(train, val): the last val_fraction of the stream is validation, at least one window of
    seq_len+1 tokens when val_fraction > 0 (val_fraction 0: empty val)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: must be in [0, 1), got {val_fraction}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if isinstance(token_file, TokenSplit):
        tokens, base, n, h = token_file.tokens, token_file.start, token_file.num_tokens, token_file.content_hash
    else:
        tokens, base, n, h = token_file.tokens, 0, token_file.num_tokens, token_file.content_hash
    w = seq_len + 1
    n_val = 0 if val_fraction == 0 else max(w, int(n * val_fraction))
    if n - n_val < w:
        raise ConfigError(f"data: the corpus has {n} tokens, too few for a training window of {w} "
                          f"tokens plus {n_val} validation tokens (seq_len {seq_len}, val_fraction {val_fraction})")
    cut = base + n - n_val
    return (TokenSplit(tokens, base, cut, "train", h), TokenSplit(tokens, cut, base + n, "val", h))


# ---------------------------------------------------------------- building and caching


def stdlib_files() -> tuple[str, list[str]]:
    """(stdlib root, sorted .py files) of the running interpreter, minus packages and tests."""
    root = os.path.realpath(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS)
        found += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return root, sorted(found)


def _glob_files(pattern: str) -> list[str]:
    pattern = os.path.expanduser(pattern)
    files = sorted(os.path.abspath(p) for p in _glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not files:
        raise ConfigError(f"data.path: no files match {pattern!r}")
    return files


def _stats(paths: list[str]) -> list[list]:
    out = []
    for p in paths:
        st = os.stat(p)
        out.append([p, st.st_size, st.st_mtime_ns])
    return out


def _key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:32]


def _tmp_name(final: str) -> str:
    return f"{final}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _atomic_write_json(path: str, obj: dict) -> None:
    tmp = _tmp_name(path)
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _read_meta(meta_path: str) -> Optional[dict]:
    """The meta of a complete cache entry, or None (missing, other format, or data file wrong size)."""
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("format") != FORMAT_VERSION:
            return None
        # Built files are recorded by name, relative to the cache folder, so the folder can move.
        meta["data_path"] = os.path.join(os.path.dirname(meta_path), meta["data_path"])
        size = os.path.getsize(meta["data_path"])
    except (OSError, ValueError, KeyError):
        return None
    if size != meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize:
        return None
    return meta


@contextmanager
def _locked(lock_path: str) -> Iterator[None]:
    # The lock file is never deleted: unlinking it would let a waiter lock an orphaned inode.
    with open(lock_path, "a") as lf:
        fcntl.flock(lf.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lf.fileno(), fcntl.LOCK_UN)


def _cached(cache_dir: str, key: str, build: Callable[[str], dict]) -> tuple[dict, bool]:
    """Return (meta, built). build(bin_path) writes the data (atomically) and returns its meta."""
    stem = os.path.join(cache_dir, f"tokens-{key}")
    meta_path = stem + ".json"
    meta = _read_meta(meta_path)  # fast path, no lock: the meta file appears only once complete
    if meta is not None:
        return meta, False
    os.makedirs(cache_dir, exist_ok=True)
    with _locked(stem + ".lock"):
        meta = _read_meta(meta_path)  # another process built it while we waited
        if meta is not None:
            return meta, False
        # Only the lock holder writes temp files for this key, so any left are from a crashed builder.
        for stale in _glob.glob(_glob.escape(stem) + ".*.tmp"):
            os.unlink(stale)
        meta = build(stem + ".bin")
        meta["format"] = FORMAT_VERSION
        _atomic_write_json(meta_path, meta)
        written = _read_meta(meta_path)
        if written is None:
            raise RuntimeError(f"token cache entry {meta_path} is inconsistent right after writing it")
        return written, True


def _write_token_file(bin_path: str, texts: Iterator[str], tokenizer: Any, dtype: np.dtype) -> dict:
    sep = [tokenizer.eos_id] if getattr(tokenizer, "eos_id", None) is not None else tokenizer.encode("\n\n")
    sep_arr = np.asarray(sep, dtype=np.int64)
    vocab = int(tokenizer.vocab_size)
    h, n, docs, max_id = hashlib.sha256(), 0, 0, -1
    tmp = _tmp_name(bin_path)
    try:
        with open(tmp, "wb") as f:
            for text in texts:
                ids = np.concatenate([np.asarray(encode_array(tokenizer, text), dtype=np.int64), sep_arr])
                if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                    raise ValueError(f"tokenizer {tokenizer!r} produced ids outside [0, {vocab})")
                raw = ids.astype(dtype).tobytes()
                f.write(raw)
                h.update(raw)
                n += ids.size
                docs += 1
                max_id = max(max_id, int(ids.max()) if ids.size else -1)
            f.flush()
            os.fsync(f.fileno())
        if n == 0:
            raise ConfigError("data: the corpus is empty (no tokens)")
        os.replace(tmp, bin_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {"data_path": os.path.basename(bin_path), "dtype": dtype.str, "num_tokens": n, "content_hash": h.hexdigest(),
            "vocab_size": vocab, "max_token_id": max_id, "num_documents": docs}


def _read_texts(paths: list[str]) -> Iterator[str]:
    for p in paths:
        with open(p, encoding="utf-8", errors="replace") as f:
            yield f.read()


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


def _hash_bin(path: str, dtype: np.dtype) -> dict:
    size = os.path.getsize(path)
    if size == 0 or size % dtype.itemsize:
        raise ConfigError(f"data.path: {path} has {size} bytes, not a whole number of {dtype.name} tokens")
    n = size // dtype.itemsize
    mm = _open_memmap(path, dtype, n)
    h, max_id = hashlib.sha256(), -1
    for a in range(0, n, _HASH_CHUNK):
        chunk = np.asarray(mm[a:a + _HASH_CHUNK])
        h.update(chunk.tobytes())
        max_id = max(max_id, int(chunk.max()))
    del mm
    return {"data_path": path, "dtype": dtype.str, "num_tokens": n, "content_hash": h.hexdigest(),
            "vocab_size": None, "max_token_id": max_id, "num_documents": None}


def build_token_file(source: str = "python-stdlib", path: Optional[Union[str, os.PathLike]] = None,
                     tokenizer: Any = "bytes", cache_dir: Optional[Union[str, os.PathLike]] = None) -> TokenFile:
    """Tokenize `source` once into the cache (or reuse it) and return the memory-mapped TokenFile.

    source: "python-stdlib" | "files" (path: a glob, or a .bin token file) | "bin" (path: a .bin).
    tokenizer: a tokenizer or a load_tokenizer spec. For a .bin it only checks that ids fit its vocab
    (pass None to skip). Safe to call from several processes at once.
    """
    if source not in SOURCES:
        raise ConfigError(f"data.source: {source!r} is not one of {', '.join(SOURCES)}")
    path = None if path is None else os.fspath(path)
    cache_dir = os.path.abspath(os.path.expanduser(os.fspath(cache_dir or default_cache_dir())))
    tok = None if tokenizer is None else load_tokenizer(tokenizer)

    if source == "bin" or (source == "files" and path and path.endswith(".bin") and not _glob.has_magic(path)):
        if not path:
            raise ConfigError("data.path: a .bin token file is required with source: bin")
        real = os.path.realpath(os.path.expanduser(path))
        if not os.path.isfile(real):
            raise ConfigError(f"data.path: no token file at {real!r}")
        dtype = bin_dtype(real)
        st = os.stat(real)
        # The .bin itself is the token file; the cache only remembers its hash (keyed by size+mtime).
        key = _key([FORMAT_VERSION, "bin", real, st.st_size, st.st_mtime_ns, dtype.str])
        meta, built = _cached(cache_dir, key, lambda _bin_path: _hash_bin(real, dtype))
        if tok is not None and meta["max_token_id"] >= tok.vocab_size:
            raise ConfigError(f"data.tokenizer: {real} holds token id {meta['max_token_id']} but the tokenizer "
                              f"vocabulary has {tok.vocab_size} ids")
        vocab = tok.vocab_size if tok is not None else None
        return TokenFile(real, meta["dtype"], meta["num_tokens"], meta["content_hash"], f"bin:{real}",
                         vocab, meta["max_token_id"], None, built, key)

    if source == "files" and path and _glob.has_magic(path):
        files = _glob_files(path)
        bins = [f for f in files if f.endswith(".bin")]
        if bins and len(bins) != len(files):
            raise ConfigError(f"data.path: {path!r} matches both token files (.bin) and text files; point it at one "
                              "kind (a glob of .bin files is read as tokens, never as text)")
        if bins:  # several pre-tokenized files: one token stream, in sorted order, never byte-tokenized as text
            return _concatenated_bins(bins, path, tok, cache_dir)
    if tok is None:
        raise ConfigError("data.tokenizer: required to tokenize text")
    if source == "python-stdlib":
        root, files = stdlib_files()
        desc = "python-stdlib"
        ident = [root, [[os.path.relpath(p, root), s, m] for p, s, m in _stats(files)]]
    else:
        if not path:
            raise ConfigError("data.path: a glob of text files is required with source: files")
        files = _glob_files(path)
        desc = f"files:{path}"
        ident = _stats(files)
    key = _key([FORMAT_VERSION, source, ident, tok.fingerprint])
    dtype = token_dtype(int(tok.vocab_size))
    meta, built = _cached(cache_dir, key, lambda bin_path: _write_token_file(bin_path, _read_texts(files), tok, dtype))
    return TokenFile(meta["data_path"], meta["dtype"], meta["num_tokens"], meta["content_hash"], desc,
                     meta["vocab_size"], meta["max_token_id"], meta["num_documents"], built, key)


def _concatenated_bins(files: list[str], pattern: str, tok: Any, cache_dir: str) -> TokenFile:
    """A glob of .bin token files as one token file in the cache (every file's dtype must agree)."""
    dtypes = {bin_dtype(f).str for f in files}
    if len(dtypes) != 1:
        raise ConfigError(f"data.path: the token files of {pattern!r} have different dtypes ({sorted(dtypes)}); "
                          "re-export them with one dtype")
    dtype = np.dtype(dtypes.pop())

    def build(bin_path: str) -> dict:
        h, n, max_id = hashlib.sha256(), 0, -1
        tmp = _tmp_name(bin_path)
        with open(tmp, "wb") as out:
            for f in files:
                meta = _hash_bin(f, dtype)  # checks the file holds whole tokens
                mm = _open_memmap(f, dtype, meta["num_tokens"])
                for a in range(0, meta["num_tokens"], _HASH_CHUNK):
                    chunk = np.asarray(mm[a:a + _HASH_CHUNK])
                    out.write(chunk.tobytes())
                    h.update(chunk.tobytes())
                del mm
                n += meta["num_tokens"]
                max_id = max(max_id, meta["max_token_id"])
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, bin_path)
        return {"data_path": bin_path, "dtype": dtype.str, "num_tokens": n, "content_hash": h.hexdigest(),
                "vocab_size": None, "max_token_id": max_id, "num_documents": None}

    key = _key([FORMAT_VERSION, "bins", _stats(files), dtype.str])
    meta, built = _cached(cache_dir, key, build)
    if tok is not None and meta["max_token_id"] >= tok.vocab_size:
        raise ConfigError(f"data.tokenizer: {pattern} holds token id {meta['max_token_id']} but the tokenizer "
                          f"vocabulary has {tok.vocab_size} ids")
    return TokenFile(meta["data_path"], meta["dtype"], meta["num_tokens"], meta["content_hash"], f"bins:{pattern}",
                     tok.vocab_size if tok is not None else None, meta["max_token_id"], None, built, key)
