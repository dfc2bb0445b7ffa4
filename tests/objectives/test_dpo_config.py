"""train.objective and train.dpo: every combination a DPO job cannot run is one message naming the key and the fix
(exit 2 from the CLI, no traceback, nothing written); a malformed preference record is named by file and line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rayspeed.config.load import load
from rayspeed.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
DPO = ["train.objective=dpo", "data.source=files", "data.path=prefs.jsonl", "data.tokenizer=tok"]

CASES = {
    "data.source: python-stdlib cannot carry preference pairs": ["data.source=python-stdlib", "data.path=null"],
    "data.source: tokens cannot carry preference pairs": ["data.source=tokens"],
    "data.tokenizer: DPO needs a transformers tokenizer": ["data.tokenizer=bytes"],
    "data.document_masking: a preference pair is one padded row": ["data.document_masking=true"],
    "parallel.cp: 2 with train.objective: dpo": ["parallel.cp=2"],
    "train.dpo.reference: resident with parallel.pp 2": ["parallel.pp=2", "train.dpo.reference=resident"],
    "model.num_experts: DPO on a mixture of experts is not built": ["model.num_experts=4"],
    "train.dpo.reference: resident keeps a whole unpartitioned copy": ["train.dpo.reference=resident",
                                                                      "parallel.zero_stage=3"],
    "train.dpo.beta: must be > 0": ["train.dpo.beta=0"],
    "train.dpo.label_smoothing: robust needs it in [0, 0.5)": ["train.dpo.loss=robust",
                                                               "train.dpo.label_smoothing=0.5"],
    "train.dpo.label_smoothing: only the robust loss reads it": ["train.dpo.label_smoothing=0.1"],
}


@pytest.mark.parametrize("message", sorted(CASES))
def test_what_a_dpo_job_cannot_run_is_named(message):
    with pytest.raises(ConfigError) as e:
        load(TINY, DPO + CASES[message])
    assert message in str(e.value), str(e.value)


def test_dpo_keys_without_the_dpo_objective_are_named():
    with pytest.raises(ConfigError, match="train.dpo.beta is set but train.objective is sft: set train.objective: dpo"):
        load(TINY, ["train.dpo.beta=0.3"])
    assert load(TINY, DPO).train.dpo.loss == "sigmoid"


def test_the_cli_refuses_with_exit_2_and_writes_nothing(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAYSPEED_HOME": str(tmp_path),
           "PYTHONPATH": str(ROOT / "platform")}
    for args in (["plan", TINY], ["train", "--config", TINY, "--launcher", "local"]):
        r = subprocess.run([sys.executable, "-m", "rayspeed", *args, "--set", "train.objective=dpo"],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
        assert "data.source: python-stdlib cannot carry preference pairs" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_malformed_preference_record_is_named_by_its_line(tmp_path):
    from _hf_models import LLAMA_TIED, save
    from rayspeed.data import DataSpec, load_tokenizer
    from rayspeed.data.pairs import build_pairs

    save(tmp_path / "m", LLAMA_TIED, tokenizer=True)
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n"
                    + json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    spec = DataSpec(source="files", path=(str(path),), tokenizer=str(tmp_path / "m"))
    with pytest.raises(ConfigError, match=f"{path}:2: a preference record needs 'chosen' and 'rejected'"):
        build_pairs(spec, str(tmp_path / "runs" / ".cache" / "data"), load_tokenizer(spec.tokenizer))
    assert not (tmp_path / "runs").exists(), "no lock file, no pairs, not even the folders made to hold them"


def test_retraining_a_dpo_job_is_refused_naming_why(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAYSPEED_HOME": str(tmp_path),
           "PYTHONPATH": str(ROOT / "platform")}
    sets = [a for s in DPO for a in ("--set", s)]
    r = subprocess.run([sys.executable, "-m", "rayspeed", "retrain", "--config", TINY, *sets], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "train.objective: dpo: retraining promotes on a re-evaluated next-token val/loss" in r.stdout + r.stderr


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    """The chat example's tokenizer (trained here with `tokenizers`, its Llama-3-style chat template)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_chat_model", ROOT / "scripts" / "make_tiny_chat_model.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    d = tmp_path_factory.mktemp("chat-tok")
    texts = [m["content"] for r in example.conversations(100) for m in r["messages"]] + ["system user assistant"]
    example.train_tokenizer(texts).save_pretrained(str(d))
    return str(d), example.preferences(6)


def _pairs(tok_dir, records, path, data_format, cache):
    from rayspeed.data import DataSpec, load_tokenizer
    from rayspeed.data.pairs import build_pairs

    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = DataSpec(source="files", path=(str(path),), tokenizer=tok_dir, format=data_format)
    pairs = build_pairs(spec, str(cache), load_tokenizer(tok_dir))
    return [pairs.pair(i) for i in range(len(pairs))]


def test_chat_format_takes_conversational_preference_records_and_text_still_does(chat_tok, tmp_path):
    """A user writing chat records writes data.format: chat: TRL's conversational pairs (explicit prompt, or implicit
    in the common messages) are rendered as under text, the same ids; text keeps taking both forms."""
    cfg = load(TINY, DPO + ["data.format=chat"])
    assert cfg.data.format == "chat" and cfg.train.objective == "dpo"
    assert load(TINY, DPO).data.format == "text"
    tok_dir, records = chat_tok
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in records]
    for rows in (records, implicit):
        as_chat = _pairs(tok_dir, rows, tmp_path / "prefs.jsonl", "chat", tmp_path / "cache")
        as_text = _pairs(tok_dir, rows, tmp_path / "prefs.jsonl", "text", tmp_path / "cache")
        assert as_chat == as_text and len(as_chat) == len(rows)
        assert all(p.prompt and p.chosen and p.rejected and p.chosen != p.rejected for p in as_chat)
    strings = [{"prompt": "What do bees make? ", "chosen": "Honey.", "rejected": "Coal."}]
    assert len(_pairs(tok_dir, strings, tmp_path / "strings.jsonl", "text", tmp_path / "cache")) == 1


def test_chat_format_names_a_string_preference_record(chat_tok, tmp_path):
    tok_dir, records = chat_tok
    rows = records[:1] + [{"prompt": "What do bees make? ", "chosen": "Honey.", "rejected": "Coal."}]
    with pytest.raises(ConfigError, match=r"data.format: chat: .*prefs.jsonl:2: 'chosen' and 'rejected' are strings.* "
                                          r"set data.format: text for string records"):
        _pairs(tok_dir, rows, tmp_path / "prefs.jsonl", "chat", tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_a_conversational_pair_with_a_role_the_template_leaves_out_is_named(chat_tok, tmp_path):
    from transformers import AutoTokenizer

    tok_dir, records = chat_tok
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.chat_template = ("{%- for m in messages %}{%- if m['role'] in ['system', 'user', 'assistant'] %}"
                         "{{- m['role'] + ': ' + m['content'] + '\\n' }}{%- endif %}{%- endfor %}"
                         "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}")
    tok.save_pretrained(str(tmp_path / "tok"))
    robot = {**records[0], "prompt": [{"role": "robot", "content": "Beep."}, *records[0]["prompt"]]}
    assert _pairs(str(tmp_path / "tok"), records[:2], tmp_path / "ok.jsonl", "chat", tmp_path / "cache")
    with pytest.raises(ConfigError, match=r"train.objective dpo: .*prefs.jsonl:2: role 'robot' is not rendered by the "
                                          r"chat template .* renders system, user, assistant: give the turn one"):
        _pairs(str(tmp_path / "tok"), [records[1], robot], tmp_path / "prefs.jsonl", "chat", tmp_path / "cache")
