"""Bad data through the real entry point (`rayspeed train`, in this process, --launcher local): exit 2, one message
naming the file or key, and nothing written (no MLflow store, no run folder, no data cache: no token shards, no
lock file, not even the folders that would have held them), also when the check needs the tokens built first."""

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


def _job(home: Path, data: dict, vocab: int = 512, train: dict | None = None) -> str:
    job = {"name": "bad-data", "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "vocab_size": vocab,
                                         "seq_len": 16},
           "data": {"val_fraction": 0.1, **data}, "train": {"global_batch_size": 2, "max_steps": 2, **(train or {})},
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
    assert not list(home.rglob("*.lock")) and not list(home.rglob("pairs-*")) and not list(home.rglob("tokens-*"))
    assert not list(home.rglob("shards-*")) and not list(home.rglob("*.rstok")) and not list(home.rglob("*.tmp"))
    assert sorted(p.name for p in home.iterdir()) == ["job.yaml"], "nor the storage folder that holds the cache"


def _jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# Qwen2.5's way with roles (written here: its text is not shipped): system, user, assistant and tool turns are
# rendered, a turn of any other role is left out without an error.
SKIPPING_TEMPLATE = (
    "{%- for m in messages %}{%- if m['role'] in ['system', 'user', 'assistant'] %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}"
    "{%- elif m['role'] == 'tool' %}{{- '<|start_header_id|>user<|end_header_id|>\\n\\n<tool_response>' + "
    "m['content'] + '</tool_response><|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


@pytest.mark.parametrize("case", ["missing-field", "empty", "no-assistant", "tokenizer-too-big", "bad-shard",
                                  "unknown-role", "dpo-no-rejected", "too-few-for-validation"])
def test_bad_data_is_exit_2_naming_it_with_nothing_written(case, tmp_path, monkeypatch, capsys, chat_tok):
    home = tmp_path / "home"
    home.mkdir()
    src = tmp_path / "src"
    src.mkdir()
    vocab, train = 512, None
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
    elif case == "unknown-role":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(chat_tok)
        tok.chat_template = SKIPPING_TEMPLATE
        tok.save_pretrained(str(src / "tok"))
        convo = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hello!"}]
        data = {"source": "files", "format": "chat", "tokenizer": str(src / "tok"),
                "path": _jsonl(src / "c.jsonl", [{"messages": convo}, {"messages": [
                    {"role": "robot", "content": "Beep."}, *convo]}])}
        needle = (f"data.format: chat: {src / 'c.jsonl'}:2: role 'robot' is not rendered by the chat template of "
                  f"TransformersTokenizer('{src / 'tok'}') (it refuses that turn or leaves it out); the template "
                  "renders system, user, assistant, tool: give the turn one of those roles")
    elif case == "dpo-no-rejected":
        data = {"source": "files", "tokenizer": chat_tok,
                "path": _jsonl(src / "prefs.jsonl", [{"prompt": "What do bees make?", "chosen": "Honey."}])}
        train = {"objective": "dpo"}
        needle = f"{src / 'prefs.jsonl'}:1: a preference record needs 'chosen' and 'rejected'"
    elif case == "too-few-for-validation":  # found once the tokens are built: what was built is removed again
        data = {"source": "files", "path": _jsonl(src / "a.jsonl", [{"text": "Hello, world: a few bytes."}] * 3)}
        needle = "data.val_fraction: the validation data holds 1 sequences of 16 tokens, fewer than one global batch"
    elif case == "tokenizer-too-big":
        data = {"source": "files", "tokenizer": chat_tok, "path": _jsonl(src / "a.jsonl", [{"text": "Hello!"}])}
        vocab, needle = 256, "data.tokenizer: TransformersTokenizer"
    else:
        write_shard(str(src / "good.rstok"), np.arange(40), [0, 40])
        (src / "bad.rstok").write_bytes((src / "good.rstok").read_bytes()[:-5])
        data = {"source": "tokens", "path": str(src / "*.rstok")}
        needle = f"data.path: {src / 'bad.rstok'} is not a rayspeed token shard"
    code, err = _train(home, _job(home, data, vocab, train), monkeypatch, capsys)
    assert code == 2, err
    assert needle in err and "Traceback" not in err, err
    assert err.count("config error:") == 1, err  # said once, not wrapped again by the driver
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
