"""Bad data through the real entry point (`rayspeed train`, in this process, --launcher local): exit 2, one message
naming the file or key, and nothing written (no MLflow store, no run folder, no token shards)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from rayspeed.config.load import parse
from rayspeed.data.shards import write_shard

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("make_tiny_chat_model", ROOT / "scripts" / "make_tiny_chat_model.py")
chat_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chat_example)


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    texts = [m["content"] for r in chat_example.conversations(100) for m in r["messages"]] + ["system user assistant"]
    chat_example.train_tokenizer(texts).save_pretrained(str(d))
    return str(d)


def _job(home: Path, data: dict, vocab: int = 512) -> str:
    job = {"name": "bad-data", "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "vocab_size": vocab,
                                         "seq_len": 16},
           "data": {"val_fraction": 0.1, **data}, "train": {"global_batch_size": 2, "max_steps": 2},
           "cluster": {"num_workers": 1}, "health": {"preflight": False}}
    path = home / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def _train(home: Path, config: str, monkeypatch, capsys) -> tuple[int, str]:
    from rayspeed.cli import main

    monkeypatch.setenv("RAYSPEED_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    code = main(["train", "--config", config, "--launcher", "local"])
    return code, capsys.readouterr().err


def _nothing_written(home: Path) -> None:
    assert not (home / "mlflow.db").exists()
    assert not (home / "runs" / "bad-data").exists()
    assert not list(home.rglob("shards-*")) and not list(home.rglob("*.rstok")) and not list(home.rglob("*.tmp"))


def _jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("case", ["missing-field", "empty", "no-assistant", "tokenizer-too-big", "bad-shard"])
def test_bad_data_is_exit_2_naming_it_with_nothing_written(case, tmp_path, monkeypatch, capsys, chat_tok):
    home = tmp_path / "home"
    home.mkdir()
    src = tmp_path / "src"
    src.mkdir()
    vocab = 512
    if case == "missing-field":
        data = {"source": "files", "path": _jsonl(src / "a.jsonl", [{"text": "ok"}, {"body": "x"}])}
        needle = f"data.text_field: {src / 'a.jsonl'}:2 has no field 'text'"
    elif case == "empty":
        data = {"source": "files", "path": _jsonl(src / "a.jsonl", [])}
        needle = "holds no records (an empty dataset)"
    elif case == "no-assistant":
        convo = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hello!"}]
        data = {"source": "files", "format": "chat", "tokenizer": chat_tok,
                "path": _jsonl(src / "c.jsonl", [{"messages": convo}, {"messages": convo[:1]}])}
        needle = f"{src / 'c.jsonl'}:2 has no assistant turn"
    elif case == "tokenizer-too-big":
        data = {"source": "files", "tokenizer": chat_tok, "path": _jsonl(src / "a.jsonl", [{"text": "Hello!"}])}
        vocab, needle = 256, "data.tokenizer: TransformersTokenizer"
    else:
        write_shard(str(src / "good.rstok"), np.arange(40), [0, 40])
        (src / "bad.rstok").write_bytes((src / "good.rstok").read_bytes()[:-5])
        data = {"source": "tokens", "path": str(src / "*.rstok")}
        needle = f"data.path: {src / 'bad.rstok'} is not a rayspeed token shard"
    code, err = _train(home, _job(home, data, vocab), monkeypatch, capsys)
    assert code == 2, err
    assert needle in err and "Traceback" not in err, err
    if case == "tokenizer-too-big":
        assert "ids but model.vocab_size is 256" in err
    _nothing_written(home)


@pytest.mark.parametrize("data, needle", [
    ({"source": "hf"}, "data.dataset: required with data.source: hf"),
    ({"source": "tokens"}, "data.path: required with data.source: tokens"),
    ({"source": "files", "path": "x.jsonl", "format": "chat"}, "data.format: chat needs a tokenizer with a chat"),
    ({"tokenizer": "model"}, "data.tokenizer: model means the tokenizer of model.pretrained"),
    ({"source": "files", "path": "x.jsonl", "streaming": True}, "data.streaming is set but data.source is files"),
    ({"source": "python-stdlib", "val_split": "validation"}, "data.val_split: data.source python-stdlib has no"),
    ({"source": "files", "path": "x.bin", "document_masking": True}, "data.document_masking: raw .bin"),
])
def test_data_keys_are_checked_before_anything_runs(data, needle):
    from rayspeed.errors import ConfigError

    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        parse({"data": data})
