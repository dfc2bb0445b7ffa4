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
    "data.format: chat is for SFT": ["data.format=chat"],
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
        build_pairs(spec, str(tmp_path / "cache"), load_tokenizer(spec.tokenizer))
    assert not list((tmp_path / "cache").glob("pairs-*.npz"))


def test_retraining_a_dpo_job_is_refused_naming_why(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAYSPEED_HOME": str(tmp_path),
           "PYTHONPATH": str(ROOT / "platform")}
    sets = [a for s in DPO for a in ("--set", s)]
    r = subprocess.run([sys.executable, "-m", "rayspeed", "retrain", "--config", TINY, *sets], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "train.objective: dpo: retraining promotes on a re-evaluated next-token val/loss" in r.stdout + r.stderr
