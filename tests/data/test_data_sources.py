"""Sources into token shards: text, JSONL, Parquet, save_to_disk folders and Hugging Face datasets (a local folder,
and a hub name read offline from the datasets cache), with real tokenizers trained here; bad input named with its
file and line, leaving nothing behind; the local process pool writes the same bytes as an inline build."""

from __future__ import annotations

import glob
import json
import os
import shutil

import numpy as np
import pytest

from rayspeed.data import DataSpec, build_token_file, load_tokenizer
from rayspeed.data import records as records_mod
from rayspeed.errors import ConfigError

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "the sun is hot", "snow is cold and white",
         "bees make honey in the hive"]


@pytest.fixture(scope="module")
def tok_json(tmp_path_factory):
    """A BPE tokenizer.json whose post-processor puts <s> before every document (its BOS), EOS </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.train_from_iterator(TEXTS * 3, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                                         show_progress=False))
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    t.save(str(path))
    return str(path)


def _spec(paths, tok, **kw):
    return DataSpec(source=kw.pop("source", "files"), path=tuple(paths), tokenizer=tok, **kw)


def _shard_bytes(tf):
    return [open(p, "rb").read() for p in tf.shards.paths]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_bos_and_eos_as_the_tokenizer_defines_them(tok_json, tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])
    tf = build_token_file(spec=_spec([str(tmp_path / "a.jsonl")], tok_json), cache_dir=str(tmp_path / "c"))
    tok = load_tokenizer(tok_json)
    assert tok.eos_id == 2 and tf.num_documents == 5 and tf.mask is None
    ids = np.asarray(tf.tokens)
    for i, text in enumerate(TEXTS):
        a = tf.doc_starts[i]
        b = tf.doc_starts[i + 1] if i + 1 < len(TEXTS) else len(ids)
        doc = ids[a:b].tolist()
        assert doc[0] == 1 and doc[-1] == 2 and tok.decode(doc[1:-1]).replace(" ", "") == text.replace(" ", "")
    assert tf.dtype == np.dtype("<u2")


def test_text_jsonl_parquet_and_saved_dataset_give_the_same_stream(tok_json, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "txt").mkdir()
    for i, t in enumerate(TEXTS):
        (tmp_path / "txt" / f"{i}.txt").write_text(t)
    _jsonl(tmp_path / "j1.jsonl", [{"body": t, "id": i} for i, t in enumerate(TEXTS[:2])])
    _jsonl(tmp_path / "j2.jsonl", [{"body": t, "id": i} for i, t in enumerate(TEXTS[2:])])
    pq.write_table(pa.table({"body": TEXTS}), tmp_path / "p.parquet", row_group_size=2)
    datasets.Dataset.from_dict({"body": TEXTS}).save_to_disk(str(tmp_path / "saved"))
    cache = str(tmp_path / "cache")
    streams = {
        "txt": build_token_file(spec=_spec([str(tmp_path / "txt" / "*.txt")], tok_json), cache_dir=cache),
        "jsonl": build_token_file(spec=_spec([str(tmp_path / "j1.jsonl"), str(tmp_path / "j2.jsonl")], tok_json,
                                             text_field="body"), cache_dir=cache),
        "parquet": build_token_file(spec=_spec([str(tmp_path / "p.parquet")], tok_json, text_field="body"),
                                    cache_dir=cache),
        "saved": build_token_file(spec=_spec([str(tmp_path / "saved")], tok_json, text_field="body"), cache_dir=cache),
    }
    ref = np.asarray(streams["txt"].tokens)
    for name, tf in streams.items():
        assert tf.num_documents == 5, name
        np.testing.assert_array_equal(np.asarray(tf.tokens), ref, err_msg=name)
    # Same tokens in one shard each: the same hash (the hash covers the shards, and j1/j2 are two shards).
    assert len({streams[k].content_hash for k in ("txt", "parquet", "saved")}) == 1
    assert len(streams["jsonl"].shards.paths) == 2 and streams["jsonl"].content_hash != streams["txt"].content_hash
    assert streams["jsonl"].built and not build_token_file(
        spec=_spec([str(tmp_path / "j1.jsonl"), str(tmp_path / "j2.jsonl")], tok_json, text_field="body"),
        cache_dir=cache).built


@pytest.mark.parametrize("lines, needle", [
    ([{"text": "ok"}, {"text": "fine"}, {"title": "none"}], r"data.text_field: .*bad.jsonl:3 has no field 'text'"),
    ([{"text": "ok"}, "{not json", {"text": "x"}], r"data.path: .*bad.jsonl:2 is not valid JSON"),
    ([{"text": "ok"}, {"text": 7}], r"bad.jsonl:2 has a non-text field 'text'"),
    ([], r"holds no records \(an empty dataset\)"),
])
def test_bad_input_names_the_file_and_line_and_leaves_nothing_behind(tok_json, tmp_path, lines, needle):
    (tmp_path / "bad.jsonl").write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match=needle):
        build_token_file(spec=_spec([str(tmp_path / "bad.jsonl")], tok_json), cache_dir=str(cache))
    assert not cache.exists()  # no shards, no temporary folder, not even the cache folder


def test_a_bad_record_in_a_later_unit_of_a_big_file_is_found_by_line(tok_json, tmp_path, monkeypatch):
    monkeypatch.setattr(records_mod, "UNIT_BYTES", 200)  # many units per file
    rows = [{"text": TEXTS[i % 5]} for i in range(40)]
    rows[33] = {"txt": "typo"}
    _jsonl(tmp_path / "big.jsonl", rows)
    units, _ = records_mod.plan_units(_spec([str(tmp_path / "big.jsonl")], tok_json))
    assert len(units) > 3 and units[0].start == 0 and units[-1].stop == os.path.getsize(tmp_path / "big.jsonl")
    assert all(a.stop == b.start for a, b in zip(units, units[1:]))
    with pytest.raises(ConfigError, match=r"big.jsonl:34 has no field 'text'"):
        build_token_file(spec=_spec([str(tmp_path / "big.jsonl")], tok_json), cache_dir=str(tmp_path / "c"))


def test_process_pool_writes_the_same_shards_as_an_inline_build(tok_json, tmp_path, monkeypatch):
    monkeypatch.setattr(records_mod, "UNIT_BYTES", 300)
    for i in range(3):
        _jsonl(tmp_path / f"part{i}.jsonl", [{"text": f"{TEXTS[(i + j) % 5]} {j}"} for j in range(12)])
    spec = _spec([str(tmp_path / "part*.jsonl")], tok_json)
    inline = build_token_file(spec=spec, cache_dir=str(tmp_path / "inline"), executor="inline")
    pool = build_token_file(spec=spec, cache_dir=str(tmp_path / "pool"), executor="pool")
    assert len(inline.shards.paths) > 3 and inline.num_documents == 36
    assert _shard_bytes(pool) == _shard_bytes(inline) and pool.content_hash == inline.content_hash


def test_uint32_ids_for_a_vocabulary_over_65536(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w3 w69999 w65535")
    tf = build_token_file(spec=_spec([str(tmp_path / "a.txt")], str(tmp_path / "tokenizer.json")),
                          cache_dir=str(tmp_path / "c"))
    assert tf.dtype == np.dtype("<u4") and tf.tokens.tolist() == [5, 70_001, 65_537, 1]


def _prefill_hub_cache(cache: str, repo: str, rows: dict[str, list[dict]], src: str) -> None:
    """What load_dataset leaves in its cache after downloading `repo` (prepared Arrow files under
    <cache>/<org>___<name>/default/<version>/<hash>), made here from local JSONL: nothing is downloaded."""
    import datasets

    files = {}
    for split, rs in rows.items():
        files[split] = os.path.join(src, f"{split}.jsonl")
        with open(files[split], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rs)
    b = datasets.load_dataset_builder("json", data_files=files, cache_dir=cache)
    b.download_and_prepare()
    version_and_hash = os.path.relpath(b.cache_dir, os.path.join(cache, "json")).split(os.sep)[1:]
    org, name = repo.split("/")
    dst = os.path.join(cache, f"{org}___{name}", "default", *version_and_hash)
    shutil.copytree(b.cache_dir, dst)
    for f in glob.glob(os.path.join(dst, "json-*")):
        os.rename(f, f.replace(os.sep + "json-", os.sep + f"{name}-"))


def test_hf_source_hub_name_offline_and_the_sources_own_validation_split(tok_json, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = str(tmp_path / "hf-cache")
    _prefill_hub_cache(cache, "acme/tiny-text", {"train": [{"text": t} for t in TEXTS],
                                                 "validation": [{"text": "the cat is white"}]}, str(tmp_path))
    spec = DataSpec(source="hf", dataset="acme/tiny-text", split="train", hf_cache_dir=cache, tokenizer=tok_json)
    train = build_token_file(spec=spec, cache_dir=str(tmp_path / "c"))
    val = build_token_file(spec=spec.with_split("validation"), cache_dir=str(tmp_path / "c"))
    assert train.num_documents == 5 and val.num_documents == 1 and train.content_hash != val.content_hash
    assert train.source == "hf:acme/tiny-text[train]"
    with pytest.raises(ConfigError, match="data.dataset: "):
        build_token_file(spec=spec.__class__(**{**spec.__dict__, "dataset": "acme/missing"}),
                         cache_dir=str(tmp_path / "c"))


def test_hf_streaming_from_a_local_dataset_folder(tok_json, tmp_path):
    (tmp_path / "ds").mkdir()
    _jsonl(tmp_path / "ds" / "train-00000.jsonl", [{"text": t} for t in TEXTS[:3]])
    _jsonl(tmp_path / "ds" / "train-00001.jsonl", [{"text": t} for t in TEXTS[3:]])
    spec = DataSpec(source="hf", dataset=str(tmp_path / "ds"), split="train", streaming=True, tokenizer=tok_json,
                    hf_cache_dir=str(tmp_path / "hf-cache"))
    streamed = build_token_file(spec=spec, cache_dir=str(tmp_path / "c"))
    (tmp_path / "all.jsonl").write_text((tmp_path / "ds" / "train-00000.jsonl").read_text()
                                        + (tmp_path / "ds" / "train-00001.jsonl").read_text())
    whole = build_token_file(spec=_spec([str(tmp_path / "all.jsonl")], tok_json), cache_dir=str(tmp_path / "c"))
    assert len(streamed.shards.paths) == 2 and streamed.num_documents == 5
    np.testing.assert_array_equal(np.asarray(streamed.tokens), np.asarray(whole.tokens))
    assert not (tmp_path / "hf-cache").exists() or not glob.glob(str(tmp_path / "hf-cache" / "**" / "*.arrow"),
                                                                  recursive=True)
