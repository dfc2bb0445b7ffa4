"""Tokenizers: bytes (vocab 256) or a Hugging Face tokenizer.json.

Every tokenizer exposes vocab_size, encode(str) -> list[int], decode(list[int]) -> str, eos_id
(the id written between documents, or None) and fingerprint (a stable string used in cache keys:
two tokenizers with the same fingerprint must produce the same ids).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Optional, Protocol, Sequence, Union, runtime_checkable

import numpy as np

from rayspeed.errors import ConfigError


class TokenizerDependencyError(ConfigError, ImportError):
    """An optional package is missing; both a ConfigError (clean CLI exit) and an ImportError."""


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eos_id: Optional[int]
    fingerprint: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def encode_array(tokenizer: Any, text: str) -> np.ndarray:
    """Encode to a 1-D integer array, using the tokenizer's fast path when it has one."""
    fast = getattr(tokenizer, "encode_array", None)
    if fast is not None:
        return fast(text)
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


class ByteTokenizer:
    """UTF-8 bytes as tokens. Byte 0 (NUL, absent from text files) separates documents."""

    vocab_size = 256
    eos_id: Optional[int] = 0
    # Bump the version if the encoding ever changes, so cached corpora are rebuilt.
    fingerprint = "bytes-utf8-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        # A window can cut a multi-byte character; replace instead of failing.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


# Tried in order when the caller does not name the end-of-document token.
_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json (the package is imported only here)."""

    def __init__(self, path: Union[str, os.PathLike], eos_token: Optional[str] = None):
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as e:
            raise TokenizerDependencyError(
                f"data.tokenizer: {os.fspath(path)!r} is a Hugging Face tokenizer, which needs the "
                "'tokenizers' package: pip install tokenizers"
            ) from e
        self.path = os.path.abspath(os.fspath(path))
        if os.path.isdir(self.path):
            self.path = os.path.join(self.path, "tokenizer.json")
        if not os.path.isfile(self.path):
            raise ConfigError(f"data.tokenizer: no tokenizer file at {self.path!r}")
        with open(self.path, "rb") as f:
            raw = f.read()
        # Content, not path: the same file copied to each node gives the same cache key.
        self.fingerprint = "hf-" + hashlib.sha256(raw).hexdigest()[:32]
        self._tok = _HFTokenizer.from_file(self.path)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        candidates = (eos_token,) if eos_token else _EOS_CANDIDATES
        self.eos_id = None
        for name in candidates:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                self.eos_id = int(tid)
                break
        if eos_token and self.eos_id is None:
            raise ConfigError(f"data.tokenizer: {eos_token!r} is not in {self.path!r}")

    def encode(self, text: str) -> list[int]:
        # No BOS/EOS added here: the corpus builder places document separators itself.
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r})"


def load_tokenizer(spec: Union[str, os.PathLike, Any] = "bytes") -> Any:
    """"bytes" -> ByteTokenizer; a path (tokenizer.json or its folder) -> HFTokenizer; a tokenizer -> itself."""
    if not isinstance(spec, (str, os.PathLike)):
        for attr in ("vocab_size", "encode", "decode", "fingerprint"):
            if not hasattr(spec, attr):
                raise TypeError(f"tokenizer {spec!r} has no {attr!r}")
        return spec
    s = os.fspath(spec)
    if s in ("bytes", "byte"):
        return ByteTokenizer()
    s = os.path.expanduser(s)
    if not os.path.exists(s):
        raise ConfigError(f"data.tokenizer: {s!r} is neither 'bytes' nor an existing tokenizer.json path")
    return HFTokenizer(s)
