"""Corpora tokenized once into the cache, memory-mapped, and their train/val split.

Sources (data.source):
  python-stdlib  the .py files of the running Python's standard library (no site-packages, no test folders:
                 ~12 MB of text, built in about a second). The demo corpus; one cached file (below).
  files          data.path: paths or globs of text files (one document each), .jsonl and .parquet files (one
                 document per record: data.text_field, or `messages` with data.format: chat) and folders saved by
                 datasets' save_to_disk; tokenized into token shards (rayspeed.data.tokenization). A .bin (or a glob
                 of .bin files) is a raw pre-tokenized token file (rayspeed.data.raw_bins), never text.
  hf             data.dataset: a Hugging Face dataset (hub name or local dataset folder), data.split; tokenized into
                 token shards like files.
  tokens         data.path: token shards already written in rayspeed's format (rayspeed.data.shards), used in place.

The stdlib corpus is one raw file: <cache_dir>/tokens-<key>.bin + .json (meta), key = hash of (format version,
source, sorted file list with sizes and mtimes, tokenizer fingerprint), uint16 when the vocabulary fits, documents
separated by the tokenizer's eos_id (byte 0 for the byte tokenizer), also after the last one. Several processes
may build at once: one builds under a lock, the others wait and reuse (rayspeed.data.cache).
"""

from __future__ import annotations

import glob as _glob
import hashlib
import os
import sysconfig
from typing import Any, Iterator, Optional, Union

import numpy as np

from rayspeed.data.cache import (
    FORMAT_VERSION,
    atomic_write_json,
    cache_key,
    cached,
    make_dirs,
    note_written,
    tmp_name,
)
from rayspeed.data.raw_bins import bin_dtype, check_fits, concatenated_bins, single_bin
from rayspeed.data.records import TOKEN_SUFFIXES, DataSpec, expand
from rayspeed.data.shards import ShardSet, read_header
from rayspeed.data.token_split import TokenSplit, split_train_val
from rayspeed.data.tokenizer import encode_array, load_tokenizer
from rayspeed.errors import ConfigError

SOURCES = ("python-stdlib", "files", "hf", "tokens", "bin")
# Folders left out of the stdlib corpus: installed packages, bytecode, and the (large) test suites.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_SCAN_CHUNK = 1 << 22

__all__ = ["TokenFile", "TokenSplit", "build_token_file", "split_train_val", "bin_dtype", "token_dtype",
           "default_cache_dir", "stdlib_files", "FORMAT_VERSION"]


def default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "rayspeed", "data")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id (0..vocab_size-1) fits, else uint32; always little-endian."""
    if vocab_size <= 1 << 16:
        return np.dtype("<u2")
    if vocab_size <= 1 << 32:
        return np.dtype("<u4")
    raise ConfigError(f"data.tokenizer: vocab_size {vocab_size} does not fit in uint32")


class TokenFile:
    """A read-only token stream plus what identifies it: one memory-mapped file (`path`), or token shards
    (`shards`, a ShardSet; `path` is then their folder).

    built: whether this call tokenized (or, for .bin, hashed) it rather than reusing the cache.
    content_hash: sha256 of the stored token bytes; a change means "the data changed".
    mask: the loss mask (chat), or None. doc_starts: where documents start (from the shards, or from the
    separators a tokenizer wrote: eos_id), or None when unknown.
    """

    def __init__(self, path: str, dtype: Any, num_tokens: int, content_hash: str, source: str,
                 vocab_size: Optional[int] = None, max_token_id: Optional[int] = None,
                 num_documents: Optional[int] = None, built: bool = False, cache_key: Optional[str] = None,
                 shards: Optional[ShardSet] = None, eos_id: Optional[int] = None):
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
        self.shards, self.eos_id = shards, eos_id
        self._doc_starts: Optional[np.ndarray] = None
        self._open()

    def _open(self) -> None:
        if self.shards is not None:
            self.tokens, self.mask = self.shards.tokens, self.shards.mask
        else:
            self.tokens, self.mask = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_tokens,)), None

    @property
    def doc_starts(self) -> Optional[np.ndarray]:
        if self.shards is not None:
            return self.shards.doc_starts
        if self._doc_starts is None and self.eos_id is not None:
            ends = [np.flatnonzero(np.asarray(self.tokens[a:a + _SCAN_CHUNK]) == self.eos_id) + a + 1
                    for a in range(0, self.num_tokens, _SCAN_CHUNK)]
            after = np.concatenate(ends) if ends else np.zeros(0, np.int64)
            self._doc_starts = np.concatenate([[0], after[after < self.num_tokens]]).astype(np.int64)
        return self._doc_starts

    def whole(self, name: str = "train") -> TokenSplit:
        return TokenSplit(self.tokens, 0, self.num_tokens, name, self.content_hash, self.mask, self.doc_starts,
                          store=self.shards)

    def split(self, val_fraction: float, seq_len: int) -> tuple[TokenSplit, TokenSplit]:
        return split_train_val(self, val_fraction, seq_len)

    def __len__(self) -> int:
        return self.num_tokens

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["tokens"], state["mask"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __repr__(self) -> str:
        return (f"TokenFile({self.source}, {self.num_tokens} tokens, {self.dtype.name}, "
                f"sha256 {self.content_hash[:12]}, {self.path})")


# ---------------------------------------------------------------- the stdlib corpus (one cached file)


def stdlib_files() -> tuple[str, list[str]]:
    """(stdlib root, sorted .py files) of the running interpreter, minus packages and tests."""
    root = os.path.realpath(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS)
        found += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return root, sorted(found)


def _write_token_file(bin_path: str, texts: Iterator[str], tokenizer: Any, dtype: np.dtype) -> dict:
    sep = [tokenizer.eos_id] if getattr(tokenizer, "eos_id", None) is not None else tokenizer.encode("\n\n")
    sep_arr = np.asarray(sep, dtype=np.int64)
    vocab = int(tokenizer.vocab_size)
    h, n, docs, max_id = hashlib.sha256(), 0, 0, -1
    tmp = tmp_name(bin_path)
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


def _stdlib(tok: Any, cache_dir: str) -> TokenFile:
    root, files = stdlib_files()
    stats = [[os.path.relpath(p, root), os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in files]
    key = cache_key([FORMAT_VERSION, "python-stdlib", [root, stats], tok.fingerprint])
    dtype = token_dtype(int(tok.vocab_size))

    def texts() -> Iterator[str]:
        for p in files:
            with open(p, encoding="utf-8", errors="replace") as f:
                yield f.read()

    meta, built = cached(cache_dir, key, lambda bin_path: _write_token_file(bin_path, texts(), tok, dtype))
    return TokenFile(meta["data_path"], meta["dtype"], meta["num_tokens"], meta["content_hash"], "python-stdlib",
                     meta["vocab_size"], meta["max_token_id"], meta["num_documents"], built, key,
                     eos_id=getattr(tok, "eos_id", None))


# ---------------------------------------------------------------- token shards


def open_shards(paths: list[str], desc: str, meta: dict[str, Any], built: bool, key: Optional[str]) -> TokenFile:
    shards = ShardSet(paths)
    dtype = shards.tokens.dtype
    return TokenFile(os.path.dirname(paths[0]), dtype, len(shards), meta["content_hash"], desc,
                     meta.get("vocab_size") or None, meta.get("max_token_id"), shards.num_documents, built, key,
                     shards=shards)


def _token_shards(spec: DataSpec, cache_dir: str, tok: Any) -> TokenFile:
    """data.source: tokens: shard files used in place; their hashes and largest id are computed once (cached by
    the files' sizes and modification times), and checked against the tokenizer (if any) before that is written."""
    files = expand(spec.path)
    for f in files:
        read_header(f)  # a file that is not a shard (a raw .bin, a text file) is refused here, named
    stats = [[f, os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files]
    key = cache_key(["rayspeed-token-shards-v1", stats])
    meta_path = os.path.join(cache_dir, f"shardmeta-{key}.json")
    meta: Optional[dict[str, Any]] = None
    if os.path.isfile(meta_path):
        import json

        with open(meta_path) as fh:
            meta = json.load(fh)
    built = meta is None
    if meta is None:
        shards = ShardSet(files)
        digests, max_id = [], -1
        for f in files:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(8 << 20), b""):
                    h.update(chunk)
            digests.append(h.hexdigest())
        for a in range(0, len(shards.tokens), _SCAN_CHUNK):
            max_id = max(max_id, int(np.asarray(shards.tokens[a:a + _SCAN_CHUNK]).max()))
        if not shards.num_documents:
            raise ConfigError(f"data.path: the token shards of {', '.join(spec.path)} hold no documents")
        meta = {"content_hash": hashlib.sha256("".join(digests).encode()).hexdigest(), "max_token_id": max_id,
                "vocab_size": shards.vocab_size}
    check_fits(meta, tok, ", ".join(spec.path))
    if built:
        make_dirs(cache_dir)
        atomic_write_json(meta_path, meta)
        note_written("entry", meta_path)
    return open_shards(files, f"tokens:{','.join(spec.path)}", meta, built, key)


# ---------------------------------------------------------------- the entry point


def build_token_file(source: str = "python-stdlib", path: Optional[Union[str, os.PathLike, list]] = None,
                     tokenizer: Any = "bytes", cache_dir: Optional[Union[str, os.PathLike]] = None, *,
                     spec: Optional[DataSpec] = None, executor: str = "inline") -> TokenFile:
    """Tokenize the corpus once into the cache (or reuse it) and return the memory-mapped TokenFile.

    source/path/tokenizer: the short form (python-stdlib, files, tokens, bin); `spec` (a DataSpec) says everything
    (hf, text fields, chat). tokenizer: a tokenizer or a load_tokenizer spec; for raw .bin files it only checks
    that ids fit its vocab (None skips that). executor: where shards are tokenized (inline | pool | ray, see
    rayspeed.data.tokenization). Safe to call from several processes at once.
    """
    if spec is not None:  # the spec names the tokenizer; a tokenizer object passed alongside is that one, loaded
        source, path = spec.source, list(spec.path) or None
        tokenizer = spec.tokenizer if isinstance(tokenizer, str) else tokenizer
    if source not in SOURCES:
        raise ConfigError(f"data.source: {source!r} is not one of {', '.join(SOURCES[:4])}")
    paths = [os.fspath(p) for p in ([path] if isinstance(path, (str, os.PathLike)) else (path or []))]
    cache_dir = os.path.abspath(os.path.expanduser(os.fspath(cache_dir or default_cache_dir())))
    if spec is None:
        spec = DataSpec(source=source, path=tuple(paths),
                        tokenizer=tokenizer if isinstance(tokenizer, str) else "<object>")
    tok = None if tokenizer is None else load_tokenizer(tokenizer)
    if source == "tokens":
        if not paths:
            raise ConfigError("data.path: token shard files are required with data.source: tokens")
        return _token_shards(spec, cache_dir, tok)
    one = paths[0] if len(paths) == 1 else ""
    if source == "bin" or (source == "files" and one.endswith(".bin") and not _glob.has_magic(one)):
        if not one:
            raise ConfigError("data.path: a .bin token file is required with source: bin")
        real, meta, built, key = single_bin(one, cache_dir, tok)
        return TokenFile(real, meta["dtype"], meta["num_tokens"], meta["content_hash"], f"bin:{real}",
                         tok.vocab_size if tok is not None else None, meta["max_token_id"], None, built, key)
    if source == "files" and paths:
        files = expand(spec.path)
        bins = [f for f in files if f.endswith(TOKEN_SUFFIXES)]
        if bins and len(bins) != len(files):
            raise ConfigError(f"data.path: {', '.join(paths)!r} matches both token files (.bin) and text files; point "
                              "it at one kind (a glob of .bin files is read as tokens, never as text)")
        if bins and all(f.endswith(".bin") for f in bins):  # several pre-tokenized files: one token stream
            meta, built, key = concatenated_bins(bins, ", ".join(paths), cache_dir, tok)
            return TokenFile(meta["data_path"], meta["dtype"], meta["num_tokens"], meta["content_hash"],
                             f"bins:{', '.join(paths)}", tok.vocab_size if tok is not None else None,
                             meta["max_token_id"], None, built, key)
    if tok is None:
        raise ConfigError("data.tokenizer: required to tokenize text")
    if source == "python-stdlib":
        return _stdlib(tok, cache_dir)
    if source == "files" and not paths:
        raise ConfigError("data.path: paths or globs of text, JSONL or Parquet files are required with source: files")
    if source == "hf" and not spec.dataset:
        raise ConfigError("data.dataset: a Hugging Face dataset name is required with data.source: hf")
    from rayspeed.data.tokenization import build_shards

    index, built = build_shards(spec, cache_dir, executor, tokenizer=tok)
    files = [os.path.join(index["dir"], s["name"]) for s in index["shards"]]
    return open_shards(files, spec.describe(), index, built, index["key"])
