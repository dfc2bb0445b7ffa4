"""Data pipeline: tokenizers, cached corpora, layout-independent deterministic batches."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rayspeed.data import (
    ByteTokenizer,
    GlobalBatchSchedule,
    HFTokenizer,
    RankBatches,
    TokenSplit,
    build_token_file,
    load_tokenizer,
    split_train_val,
    val_batches,
)
from rayspeed.errors import ConfigError

PLATFORM_DIR = Path(__file__).resolve().parents[2] / "platform"


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
    text = "def f(x):\n    return x  # héllo ✓ 🚀\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert np.array_equal(tok.encode_array(text), ids)
    assert tok.fingerprint == ByteTokenizer().fingerprint and isinstance(tok.fingerprint, str)
    assert tok.decode(ids[:-3] + [0xE2]).endswith("\ufffd")  # a cut multi-byte char does not raise


def test_hf_tokenizer_missing_package_says_pip_install(tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match="pip install tokenizers") as err:
        load_tokenizer(str(path))
    assert isinstance(err.value, ConfigError)


def _word_level(vocab: dict[str, int]):
    """A word-level tokenizer over a fixed vocabulary, made with the `tokenizers` library."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return t


def test_hf_tokenizer_wiring(tmp_path):
    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    (tmp_path / "a").mkdir()
    _word_level(vocab).save(str(tmp_path / "a" / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path / "a"))  # a folder holding tokenizer.json works too
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == 4 and tok.eos_id == 1
    assert tok.encode("hello world hello") == [2, 3, 2] and tok.decode([2, 3]) == "hello world"
    assert tok.encode("hello moon") == [2, 0]
    # The fingerprint follows the content, not the location.
    _word_level(vocab).save(str(tmp_path / "b.json"))
    assert HFTokenizer(tmp_path / "b.json").fingerprint == tok.fingerprint
    _word_level({**vocab, "x": 4}).save(str(tmp_path / "c.json"))
    assert HFTokenizer(tmp_path / "c.json").fingerprint != tok.fingerprint
    # A corpus built with it uses its eos between documents.
    (tmp_path / "d1.txt").write_text("hello world")
    (tmp_path / "d2.txt").write_text("world")
    tf = build_token_file("files", str(tmp_path / "d*.txt"), tok, tmp_path / "cache")
    assert tf.tokens.tolist() == [2, 3, 1, 3, 1]


def test_hf_tokenizer_trained_here(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    t = Tokenizer(models.WordLevel(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.train_from_iterator(["hello world", "hello there"], trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    t.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.eos_id == 1 and tok.decode(tok.encode("hello world")) == "hello world"


# ---------------------------------------------------------------- corpus


class _CountingTokenizer(ByteTokenizer):
    """The byte tokenizer (same fingerprint, so the same cache entry), counting the texts it encodes."""

    def __init__(self):
        self.calls = 0

    def encode_array(self, text):
        self.calls += 1
        return super().encode_array(text)


def test_stdlib_corpus_is_built_once_and_cached(tmp_path):
    tok = _CountingTokenizer()
    tf = build_token_file("python-stdlib", None, tok, str(tmp_path))
    assert tf.built and tok.calls > 100  # every file of the standard library, once
    assert 1_000_000 < tf.num_tokens < 40_000_000 and tf.dtype == np.dtype("<u2")
    assert not tf.tokens.flags.writeable
    raw = Path(tf.path).read_bytes()
    assert hashlib.sha256(raw).hexdigest() == tf.content_hash
    assert b"import " in raw[:2_000_000:2]  # uint16 bytes: every other byte is the text
    mtime = os.stat(tf.path).st_mtime_ns
    tok.calls = 0
    again = build_token_file("python-stdlib", None, tok, str(tmp_path))
    assert not again.built and again.path == tf.path and again.content_hash == tf.content_hash
    assert tok.calls == 0 and os.stat(tf.path).st_mtime_ns == mtime  # read from the cache, nothing tokenized
    assert build_token_file("python-stdlib", None, "bytes", str(tmp_path)).path == tf.path  # the byte tokenizer's own
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".bin", ".json"]  # no lock file outlives the build


_BUILD_SNIPPET = textwrap.dedent("""
    import json, os, sys, time
    from rayspeed.data.corpus import build_token_file
    cache, ready_dir, me = sys.argv[1], sys.argv[2], sys.argv[3]
    open(os.path.join(ready_dir, me), "w").close()
    deadline = time.time() + 60
    while len(os.listdir(ready_dir)) < 2 and time.time() < deadline:  # start both builds together
        time.sleep(0.001)
    tf = build_token_file("python-stdlib", None, "bytes", cache)
    print(json.dumps({"built": tf.built, "path": tf.path, "hash": tf.content_hash, "n": tf.num_tokens}))
""")


def test_concurrent_builds_from_two_processes_make_one_file(tmp_path):
    cache, ready = tmp_path / "cache", tmp_path / "ready"
    ready.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLATFORM_DIR), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD_SNIPPET, str(cache), str(ready), f"p{i}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["built"] for r in results) == [False, True]
    assert len({(r["path"], r["hash"], r["n"]) for r in results}) == 1
    names = sorted(os.listdir(cache))
    assert len([n for n in names if n.endswith(".bin")]) == 1 and not [n for n in names if n.endswith(".tmp")]
    # Same bytes as a build in this process.
    assert build_token_file("python-stdlib", None, "bytes", str(tmp_path / "other")).content_hash == results[0]["hash"]


class _SlowCountingTokenizer(ByteTokenizer):
    fingerprint = "slow-bytes-test"

    def __init__(self):
        self.calls = 0

    def encode_array(self, text):
        self.calls += 1
        time.sleep(0.2)  # long enough that the second builder surely arrives while the first holds the lock
        return super().encode_array(text)


def test_concurrent_builds_wait_on_the_lock(tmp_path):
    (tmp_path / "a.txt").write_text("abc")
    tok = _SlowCountingTokenizer()
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        build_token_file("files", str(tmp_path / "*.txt"), tok, str(tmp_path / "cache")))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(r.built for r in results) == [False, True]
    assert tok.calls == 1  # tokenized once; the other waited and reused
    assert results[0].tokens.tolist() == results[1].tokens.tolist() == [97, 98, 99, 0]


def test_files_glob_source(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("bb")
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "sub" / "c.txt").write_text("ccc")
    (tmp_path / "skip.md").write_text("no")
    cache = str(tmp_path / "cache")
    tf = build_token_file("files", str(tmp_path / "**" / "*.txt"), "bytes", cache)
    # Sorted paths, each document followed by the byte tokenizer's separator 0.
    assert tf.tokens.tolist() == [97, 0, 98, 98, 0, 99, 99, 99, 0] and tf.num_documents == 3
    assert not build_token_file("files", str(tmp_path / "**" / "*.txt"), "bytes", cache).built
    time.sleep(0.01)
    (tmp_path / "a.txt").write_text("A")  # the data changed: new key, new hash
    tf2 = build_token_file("files", str(tmp_path / "**" / "*.txt"), "bytes", cache)
    assert tf2.built and tf2.content_hash != tf.content_hash and tf2.tokens[0] == 65
    with pytest.raises(ConfigError, match="no files match"):
        build_token_file("files", str(tmp_path / "*.nothing"), "bytes", cache)
    with pytest.raises(ConfigError, match="data.source"):
        build_token_file("web", None, "bytes", cache)


def test_bin_source(tmp_path):
    toks = (np.arange(1000) * 7 % 50_000).astype("<u2")
    path = tmp_path / "pre.bin"
    toks.tofile(path)
    tf = build_token_file("files", path, None, tmp_path / "cache")  # os.PathLike accepted
    assert tf.path == str(path) and tf.dtype == np.dtype("<u2") and tf.num_tokens == 1000
    assert np.array_equal(tf.tokens, toks) and tf.content_hash == hashlib.sha256(toks.tobytes()).hexdigest()
    assert tf.built and not build_token_file("bin", str(path), None, str(tmp_path / "cache")).built
    with pytest.raises(ConfigError, match="vocabulary has 256"):  # ids do not fit the byte tokenizer
        build_token_file("files", str(path), "bytes", str(tmp_path / "cache"))
    # uint32 through a sidecar.
    big = np.array([70_000, 1, 2, 3], dtype="<u4")
    big.tofile(tmp_path / "big.bin")
    (tmp_path / "big.bin.json").write_text(json.dumps({"dtype": "uint32"}))
    tf32 = build_token_file("files", str(tmp_path / "big.bin"), None, str(tmp_path / "cache"))
    assert tf32.dtype == np.dtype("<u4") and tf32.tokens.tolist() == [70_000, 1, 2, 3]
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ConfigError, match="whole number"):
        build_token_file("files", str(tmp_path / "odd.bin"), None, str(tmp_path / "cache"))


def test_val_split_sizes(tmp_path):
    toks = np.arange(10_000, dtype="<u2")
    toks.tofile(tmp_path / "t.bin")
    tf = build_token_file("bin", str(tmp_path / "t.bin"), None, str(tmp_path / "c"))
    train, val = tf.split(0.1, seq_len=15)
    assert (train.start, train.stop, val.start, val.stop) == (0, 9000, 9000, 10_000)
    assert val.windows([0], 15)[0].tolist() == list(range(9000, 9016))
    assert train.num_sequences(15) == 9000 // 16 and val.num_sequences(15) == 1000 // 16
    _, tiny = split_train_val(tf, 1e-6, seq_len=63)
    assert tiny.num_tokens == 64 and tiny.num_sequences(63) == 1  # at least one sequence
    _, none = tf.split(0.0, 15)
    assert none.num_tokens == 0
    with pytest.raises(ConfigError):
        tf.split(0.5, seq_len=6000)  # not even one training window left
    with pytest.raises(ConfigError):
        tf.split(1.0, seq_len=15)


def test_token_split_pickles_by_file_name(tmp_path):
    np.arange(100_000, dtype="<u2").tofile(tmp_path / "t.bin")
    tf = build_token_file("bin", str(tmp_path / "t.bin"), None, str(tmp_path / "c"))
    train, _ = tf.split(0.1, 31)
    blob = pickle.dumps(train)
    assert len(blob) < 2_000  # not the 200 KB of tokens
    again = pickle.loads(blob)
    assert np.array_equal(again.windows([3, 5], 31), train.windows([3, 5], 31))
    assert pickle.loads(pickle.dumps(tf)).tokens[12] == 12


# ---------------------------------------------------------------- batches

SEQ_LEN = 5
N_SEQ = 40
G = 16
SEED = 7
# (dp, micro_batch_size, grad_accum), all with G = 16
LAYOUTS = [(1, 16, 1), (2, 4, 2), (4, 1, 4), (2, 8, 1), (8, 2, 1), (1, 1, 16)]
# 8 steps * 16 = 128 samples over 40 sequences: epochs 0..3, steps 2, 5 and 7 straddle a boundary.
STEPS = range(8)


def _split(extra_tokens: int = 3) -> TokenSplit:
    # Token value = its position, so a window's first token tells which sequence it is.
    return TokenSplit(np.arange(N_SEQ * (SEQ_LEN + 1) + extra_tokens, dtype=np.int64), name="train")


def _global_batch(split, step, dp, b, acc, seed=SEED):
    """Reassemble step's global batch from every rank and micro-step of one layout."""
    sched = GlobalBatchSchedule(split.num_sequences(SEQ_LEN), G, seed)
    x_all = torch.full((G, SEQ_LEN), -1, dtype=torch.long)
    y_all = torch.full((G, SEQ_LEN), -1, dtype=torch.long)
    for r in range(dp):
        rb = RankBatches(split, SEQ_LEN, sched, r, dp, b, acc)
        micro = rb.get(step)
        assert len(micro) == acc
        for k, (x, y) in enumerate(micro):
            assert x.dtype == torch.long and x.shape == (b, SEQ_LEN) and y.shape == (b, SEQ_LEN)
            pos = torch.from_numpy(rb.positions(k))
            assert (x_all[pos] == -1).all()  # no position filled twice
            x_all[pos], y_all[pos] = x, y
    assert (x_all >= 0).all()  # every position filled
    return x_all, y_all


def test_global_batch_is_identical_across_layouts():
    split = _split()
    sched = GlobalBatchSchedule(N_SEQ, G, SEED)
    for step in STEPS:
        ref_x, ref_y = _global_batch(split, step, *LAYOUTS[0])
        expected = split.windows(sched.indices(step), SEQ_LEN)
        assert torch.equal(ref_x, torch.from_numpy(expected[:, :-1]))
        assert torch.equal(ref_y, torch.from_numpy(expected[:, 1:]))  # labels = inputs shifted by one
        for layout in LAYOUTS[1:]:
            x, y = _global_batch(split, step, *layout)
            assert torch.equal(x, ref_x) and torch.equal(y, ref_y), (step, layout)


def test_schedule_is_a_seeded_permutation_per_epoch():
    sched = GlobalBatchSchedule(N_SEQ, G, SEED)
    flat = np.concatenate([sched.indices(s) for s in range(10)])  # 160 samples = 4 epochs
    epochs = flat.reshape(4, N_SEQ)
    for e in range(4):
        assert sorted(epochs[e].tolist()) == list(range(N_SEQ))  # each sequence once per epoch
    assert not np.array_equal(epochs[0], epochs[1])  # reshuffled every epoch
    assert sched.epoch_of(2) == 0 and sched.epoch_of(3) == 1
    assert np.array_equal(GlobalBatchSchedule(N_SEQ, G, SEED).indices(5), sched.indices(5))  # reproducible
    assert not np.array_equal(GlobalBatchSchedule(N_SEQ, G, SEED + 1).indices(0), sched.indices(0))
    assert sched.index(2, 9) == sched.indices(2)[9]
    # The global batch size changes the batches, never which sequence sample g is.
    other = GlobalBatchSchedule(N_SEQ, 8, SEED)
    for s in range(4):
        assert np.array_equal(np.concatenate([other.indices(2 * s), other.indices(2 * s + 1)]), sched.indices(s))


def test_layout_must_multiply_to_global_batch():
    split = _split()
    sched = GlobalBatchSchedule(N_SEQ, G, SEED)
    with pytest.raises(ValueError, match="global batch size 16"):
        RankBatches(split, SEQ_LEN, sched, 0, 2, 4, 1)
    with pytest.raises(ValueError, match="dp_rank"):
        RankBatches(split, SEQ_LEN, sched, 2, 2, 4, 2)
    with pytest.raises(ValueError, match="sequences"):
        RankBatches(split, SEQ_LEN, GlobalBatchSchedule(N_SEQ + 1, G, SEED), 0, 2, 4, 2)


def test_resume_from_state_dict_continues_identically():
    split = _split()
    sched = GlobalBatchSchedule(N_SEQ, G, SEED)
    run = RankBatches(split, SEQ_LEN, sched, 1, 2, 4, 2)
    steps = [s for s, _ in run.iterate(num_steps=3)]
    assert steps == [0, 1, 2]
    state = json.loads(json.dumps(run.state_dict()))  # checkpoint-friendly
    assert state["step"] == 3
    expected = [next(run) for _ in range(3)]
    # Same layout, fresh object (a restarted worker).
    resumed = RankBatches(split, SEQ_LEN, GlobalBatchSchedule(N_SEQ, G, SEED), 1, 2, 4, 2)
    resumed.load_state_dict(state)
    for (s_exp, mb_exp), (s, mb) in zip(expected, resumed.iterate(num_steps=3)):
        assert s == s_exp and all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(mb_exp, mb))
    assert resumed.state_dict()["step"] == 6
    # Another layout resumes the same global batch sequence.
    for dp, b, acc in [(4, 1, 4), (1, 16, 1)]:
        ranks = [RankBatches(split, SEQ_LEN, GlobalBatchSchedule(N_SEQ, G, SEED), r, dp, b, acc) for r in range(dp)]
        for rb in ranks:
            rb.load_state_dict(state)
        assert {rb.step for rb in ranks} == {3}
        x, _ = _global_batch(split, 3, dp, b, acc)
        assert torch.equal(x, _global_batch(split, 3, 2, 4, 2)[0])
    with pytest.raises(ValueError, match="seed"):
        RankBatches(split, SEQ_LEN, GlobalBatchSchedule(N_SEQ, G, SEED + 1), 0, 1, 16, 1).load_state_dict(state)
    changed = TokenSplit(split.tokens, 0, None, "train", content_hash="b" * 64)
    state_h = {**state, "content_hash": "a" * 64}
    with pytest.raises(ValueError, match="data changed"):
        RankBatches(changed, SEQ_LEN, sched, 0, 1, 16, 1).load_state_dict(state_h)
    lenient = RankBatches(changed, SEQ_LEN, sched, 0, 1, 16, 1)
    lenient.load_state_dict(state_h, strict=False)
    assert lenient.step == 3


class _RecordingTokens:
    """A token array that records every read."""

    def __init__(self, arr):
        self.arr, self.reads = arr, []

    def __len__(self):
        return len(self.arr)

    def __getitem__(self, key):
        self.reads.append(key)
        return self.arr[key]


def test_each_rank_reads_only_its_share():
    w = SEQ_LEN + 1
    sched = GlobalBatchSchedule(N_SEQ, G, SEED)
    for dp, b, acc in LAYOUTS:
        for step in (0, 2):
            seen = []
            for r in range(dp):
                tokens = _RecordingTokens(np.arange(N_SEQ * w, dtype=np.int64))
                rb = RankBatches(TokenSplit(tokens), SEQ_LEN, sched, r, dp, b, acc)
                rb.get(step)
                assert all(isinstance(k, slice) and k.stop - k.start == w for k in tokens.reads)
                read_seqs = [k.start // w for k in tokens.reads]
                mine = np.concatenate([sched.indices(step, rb.positions(k)) for k in range(acc)])
                assert read_seqs == mine.tolist() and len(read_seqs) == b * acc
                seen += read_seqs
            assert sorted(seen) == sorted(sched.indices(step).tolist())  # ranks together read the batch once


def test_iteration_from_a_start_step():
    split = _split()
    rb = RankBatches(split, SEQ_LEN, GlobalBatchSchedule(N_SEQ, G, SEED), 0, 2, 8, 1, start_step=5)
    assert [s for s, _ in rb.iterate(num_steps=2)] == [5, 6]
    assert [s for s, _ in rb.iterate(start_step=1, num_steps=1)] == [1]
    assert rb.state_dict()["step"] == 2 and next(iter(rb))[0] == 2


def test_val_batches_are_fixed_and_sharded():
    w = SEQ_LEN + 1
    val = TokenSplit(np.arange(1000 + 23 * w, dtype=np.int64), start=1000, name="val")  # 23 windows
    full = val_batches(val, SEQ_LEN, batch_size=4, num_batches=2, dp_rank=0, dp_size=1)
    assert len(full) == 2 and full[0][0][:, 0].tolist() == [1000 + i * w for i in range(4)]
    ref = torch.cat([x for x, _ in full])
    parts = [val_batches(val, SEQ_LEN, 2, 2, r, 2) for r in range(2)]
    # Batch j of rank r is windows j*B + r*b ..: interleaving the ranks gives back the dp=1 order.
    inter = torch.cat([torch.cat([parts[r][j][0] for r in range(2)]) for j in range(2)])
    assert torch.equal(inter, ref)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(parts[1], val_batches(val, SEQ_LEN, 2, 2, 1, 2)))
    x, y = full[1]
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert len(val_batches(val, SEQ_LEN, 4, 100, 0, 2)) == 23 // 8  # capped by what exists
    with pytest.raises(ValueError, match="fewer than one validation batch"):
        val_batches(val, SEQ_LEN, 16, 1, 0, 2)


def test_end_to_end_on_the_stdlib_corpus(tmp_path):
    tf = build_token_file("python-stdlib", None, "bytes", str(tmp_path))
    train, val = tf.split(0.01, seq_len=128)
    sched = GlobalBatchSchedule(train.num_sequences(128), 16, 1234)
    rb = RankBatches(train, 128, sched, 1, 2, 4, 2)
    step, micro = next(rb)
    assert step == 0 and len(micro) == 2 and micro[0][0].shape == (4, 128)
    assert int(micro[0][0].max()) < 256
    text = ByteTokenizer().decode(micro[0][0][0].tolist())
    assert len(text) > 0
    vb = val_batches(val, 128, 4, 2, 0, 2)
    assert len(vb) == 2 and vb[0][0].shape == (4, 128)


def test_a_glob_of_token_files_is_read_as_tokens_never_as_text(tmp_path):
    """Like configs/llama-70b-64xh100.yaml's data.path: several .bin files are one token stream (before, the glob was
    read as UTF-8 text and byte-tokenized: twice as many "tokens", all garbage)."""
    import numpy as np

    from rayspeed.data.corpus import build_token_file

    parts = [np.arange(i * 60, i * 60 + 50 * (i + 1), dtype="<u2") % 256 for i in range(3)]
    for i, a in enumerate(parts):
        a.tofile(tmp_path / f"shard{i}.bin")
    tf = build_token_file("files", str(tmp_path / "shard*.bin"), "bytes", str(tmp_path / "cache"))
    assert len(tf) == sum(len(a) for a in parts)
    train, val = tf.split(0.1, 8)
    got = np.concatenate([np.asarray(train.tokens[train.start:train.stop]), np.asarray(val.tokens[val.start:val.stop])])
    np.testing.assert_array_equal(got, np.concatenate(parts))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConfigError, match="both token files"):
        build_token_file("files", str(tmp_path / "*"), "bytes", str(tmp_path / "cache"))
