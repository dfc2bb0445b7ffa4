"""Token shards: the documented binary format, its checks, and `data.source: tokens` reading them in place."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from rayspeed.data import build_token_file
from rayspeed.data.shards import HEADER_SIZE, MAGIC, Concat, ShardSet, read_header, write_shard
from rayspeed.errors import ConfigError


def _docs(rng, n, vocab):
    return [rng.integers(0, vocab, size=int(rng.integers(1, 30))) for _ in range(n)]


def _write(path, docs, mask=False, vocab=1000):
    tokens = np.concatenate(docs)
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    m = (np.arange(tokens.size) % 3 == 0).astype(np.uint8) if mask else None
    return write_shard(str(path), tokens, offsets, m, vocab_size=vocab), tokens, offsets, m


def test_the_documented_layout_byte_by_byte(tmp_path):
    """A reader written from the README's table alone finds the tokens, offsets and mask where it says."""
    rng = np.random.default_rng(0)
    docs = _docs(rng, 5, 1000)
    entry, tokens, offsets, mask = _write(tmp_path / "a.rstok", docs, mask=True)
    raw = (tmp_path / "a.rstok").read_bytes()
    magic, hsize, width, n_tok, n_doc, flags, vocab = struct.unpack("<8sIIQQII", raw[:40])
    assert (magic, hsize, width, n_tok, n_doc, flags, vocab) == (MAGIC, 64, 2, tokens.size, 5, 1, 1000)
    assert raw[40:64] == b"\0" * 24
    tok_end = 64 + tokens.size * 2
    np.testing.assert_array_equal(np.frombuffer(raw[64:tok_end], "<u2"), tokens)
    off_at = 64 + (tokens.size * 2 + 7) // 8 * 8
    np.testing.assert_array_equal(np.frombuffer(raw[off_at:off_at + 8 * 6], "<u8"), offsets)
    np.testing.assert_array_equal(np.frombuffer(raw[off_at + 48:], np.uint8), mask)
    assert entry["sha256"] == hashlib.sha256(raw).hexdigest() and entry["bytes"] == len(raw)


def test_uint32_ids_when_the_vocabulary_exceeds_uint16(tmp_path):
    entry, tokens, _, _ = _write(tmp_path / "big.rstok", [np.array([70_000, 3, 65_535, 65_536])], vocab=80_000)
    h = read_header(str(tmp_path / "big.rstok"))
    assert h.width == 4 and h.dtype == np.dtype("<u4")
    assert ShardSet([str(tmp_path / "big.rstok")]).tokens.tolist() == [70_000, 3, 65_535, 65_536]


@pytest.mark.parametrize("damage, needle", [
    (lambda raw: b"RAWBYTES" + raw[8:], "magic"),
    (lambda raw: raw[:-3], "needs"),
    (lambda raw: raw[:40], "shorter than the 64-byte header"),
    (lambda raw: raw[:12] + struct.pack("<I", 3) + raw[16:], "token width 3"),
    (lambda raw: raw[:32] + struct.pack("<I", 6) + raw[36:], "unknown flags"),
])
def test_a_header_that_does_not_match_the_format_is_refused_naming_the_file(tmp_path, damage, needle):
    _write(tmp_path / "good.rstok", [np.arange(10)])
    bad = tmp_path / "bad.rstok"
    bad.write_bytes(damage((tmp_path / "good.rstok").read_bytes()))
    with pytest.raises(ConfigError, match=needle) as e:
        build_token_file("tokens", str(tmp_path / "*.rstok"), None, str(tmp_path / "cache"))
    assert str(bad) in str(e.value) and "docs/DATA.md 'Token shards'" in str(e.value)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def test_a_raw_bin_is_not_a_shard(tmp_path):
    np.arange(100, dtype="<u2").tofile(tmp_path / "raw.bin")
    with pytest.raises(ConfigError, match="not a rayspeed token shard"):
        build_token_file("tokens", str(tmp_path / "raw.bin"), None, str(tmp_path / "cache"))


def test_tokens_source_reads_several_shards_in_place_as_one_stream(tmp_path):
    rng = np.random.default_rng(1)
    parts = [_write(tmp_path / f"part-{i}.rstok", _docs(rng, 4 + i, 500), mask=True, vocab=500) for i in range(3)]
    tf = build_token_file("tokens", str(tmp_path / "part-*.rstok"), None, str(tmp_path / "cache"))
    assert tf.built and tf.num_documents == 4 + 5 + 6
    all_tokens = np.concatenate([p[1] for p in parts])
    np.testing.assert_array_equal(np.asarray(tf.tokens), all_tokens)
    np.testing.assert_array_equal(np.asarray(tf.mask), np.concatenate([p[3] for p in parts]))
    starts = np.concatenate([p[2][:-1] + sum(q[1].size for q in parts[:i]) for i, p in enumerate(parts)])
    np.testing.assert_array_equal(tf.doc_starts, starts)
    digests = "".join(p[0]["sha256"] for p in parts)
    assert tf.content_hash == hashlib.sha256(digests.encode()).hexdigest()
    assert tf.max_token_id == int(all_tokens.max())
    again = build_token_file("tokens", str(tmp_path / "part-*.rstok"), None, str(tmp_path / "cache"))
    assert not again.built and again.content_hash == tf.content_hash
    with pytest.raises(ConfigError, match="vocabulary has 256"):  # ids beyond the tokenizer's vocabulary
        build_token_file("tokens", str(tmp_path / "part-*.rstok"), "bytes", str(tmp_path / "cache"))


def test_concat_slices_across_parts():
    parts = [np.arange(0, 5), np.arange(5, 5), np.arange(5, 12), np.arange(12, 13)]
    c = Concat([p for p in parts if len(p)])
    assert len(c) == 13 and c[3:9].tolist() == list(range(3, 9)) and c[11:13].tolist() == [11, 12]
    assert c[12] == 12 and c[-1] == 12 and c[4:4].size == 0 and c.tolist() == list(range(13))


def test_header_offsets_are_checked(tmp_path):
    with pytest.raises(ValueError, match="offsets"):
        write_shard(str(tmp_path / "x.rstok"), np.arange(5), [0, 3, 2, 5])
    assert HEADER_SIZE == 64
