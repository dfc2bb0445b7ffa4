"""Tokenizers: bytes (vocab 256), a Hugging Face tokenizer.json (the `tokenizers` library), or a saved
transformers tokenizer directory (tokenizer.json + tokenizer_config.json, with its chat template).

Every tokenizer exposes vocab_size, encode(str) -> list[int] (no special tokens), encode_document(str) ->
ids of one training document (BOS and EOS as the tokenizer defines them: BOS where its post-processor adds
one, EOS appended unless already there), decode(list[int]) -> str, eos_id (None: no EOS, documents are
separated by "\n\n") and fingerprint (a stable string used in cache keys: two tokenizers with the same
fingerprint must produce the same ids). A transformers tokenizer also has `hf` (the transformers object, for
chat templates).
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

    def encode_document(self, text: str) -> np.ndarray:
        return np.append(self.encode_array(text).astype(np.int64), 0)

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
        # Content, not path: the same file copied to each node gives the same cache key. (hf2: documents carry
        # the special tokens the tokenizer's post-processor adds.)
        self.fingerprint = "hf2-" + hashlib.sha256(raw).hexdigest()[:32]
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

    def encode_document(self, text: str) -> np.ndarray:
        return with_eos(self._tok.encode(text, add_special_tokens=True).ids, self.eos_id, self)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r})"


def with_eos(ids: Sequence[int], eos_id: Optional[int], tokenizer: Any) -> np.ndarray:
    """A document's ids ending with EOS (added unless the tokenizer put it there), or with "\n\n" without one."""
    a = np.asarray(ids, dtype=np.int64)
    if eos_id is None:
        return np.concatenate([a, np.asarray(tokenizer.encode("\n\n"), dtype=np.int64)])
    return a if a.size and a[-1] == eos_id else np.append(a, eos_id)


def encode_document(tokenizer: Any, text: str) -> np.ndarray:
    """One training document (see the module docstring), for any tokenizer (one without encode_document: its
    ids and its eos_id)."""
    fn = getattr(tokenizer, "encode_document", None)
    if fn is not None:
        return np.asarray(fn(text), dtype=np.int64)
    return with_eos(encode_array(tokenizer, text), getattr(tokenizer, "eos_id", None), tokenizer)


class TransformersTokenizer:
    """A tokenizer saved by transformers (a directory with tokenizer_config.json), loaded with AutoTokenizer: its
    special tokens, BOS/EOS and chat template are the ones the model was released with."""

    FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
             "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")

    def __init__(self, path: Union[str, os.PathLike]):
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise TokenizerDependencyError(f"data.tokenizer: {os.fspath(path)!r} is a transformers tokenizer, which "
                                           "needs the 'transformers' package: pip install transformers") from e
        self.path = os.path.abspath(os.fspath(path))
        h = hashlib.sha256(b"transformers-v1")
        for name in self.FILES:
            f = os.path.join(self.path, name)
            if os.path.isfile(f):
                h.update(name.encode())
                with open(f, "rb") as fh:
                    h.update(hashlib.sha256(fh.read()).digest())
        self.fingerprint = "tf-" + h.hexdigest()[:32]
        try:
            self.hf = AutoTokenizer.from_pretrained(self.path)
        except Exception as e:
            raise ConfigError(f"data.tokenizer: transformers cannot load the tokenizer in {self.path} "
                              f"({str(e).splitlines()[0][:300]})") from None
        self.vocab_size = int(len(self.hf))
        self.eos_id = self.hf.eos_token_id
        self.bos_id = self.hf.bos_token_id

    @property
    def chat_template(self) -> Optional[str]:
        return getattr(self.hf, "chat_template", None)

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def encode_document(self, text: str) -> np.ndarray:
        return with_eos(self.hf(text, add_special_tokens=True)["input_ids"], self.eos_id, self)

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"TransformersTokenizer({self.path!r})"


def load_tokenizer(spec: Union[str, os.PathLike, Any] = "bytes") -> Any:
    """"bytes" -> ByteTokenizer; a directory saved by transformers (with tokenizer_config.json) ->
    TransformersTokenizer; a tokenizer.json (or a folder with only that) -> HFTokenizer; a tokenizer -> itself."""
    if not isinstance(spec, (str, os.PathLike)):
        for attr in ("vocab_size", "encode", "decode", "fingerprint"):
            if not hasattr(spec, attr):
                raise TypeError(f"tokenizer {spec!r} has no {attr!r}")
        return spec
    s = os.fspath(spec)
    if s in ("bytes", "byte"):
        return ByteTokenizer()
    if s == "model":
        raise ConfigError("data.tokenizer: 'model' names the tokenizer of model.pretrained; set model.pretrained")
    s = os.path.expanduser(s)
    if not os.path.exists(s):
        raise ConfigError(f"data.tokenizer: {s!r} is neither 'bytes', 'model' nor an existing tokenizer.json or "
                          "tokenizer directory")
    if os.path.isdir(s) and os.path.isfile(os.path.join(s, "tokenizer_config.json")):
        return TransformersTokenizer(s)
    return HFTokenizer(s)
