"""model.adapter's keys: every one documented by `rayspeed keys`, bad values one message each naming the key and
the fix (exit 2 from the CLI, no traceback, nothing written), and what the roles and the scale mean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rayspeed.config import adapter as spec
from rayspeed.config.load import describe_keys, parse
from rayspeed.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_every_adapter_key_is_documented():
    keys = {k: doc for k, _, doc in describe_keys() if k.startswith("model.adapter.")}
    assert set(keys) == {f"model.adapter.{k}" for k in ("type", "rank", "alpha", "dropout", "targets", "trainable",
                                                        "rslora", "dora", "base_precision")}
    assert all(len(doc) > 20 for doc in keys.values())


def test_roles_and_scale():
    a = parse({"model": {"adapter": {"type": "lora", "rank": 16, "alpha": 32, "targets": ["v", "q"]}}}).model.adapter
    assert spec.target_roles(a) == ("q", "v") and spec.scale(a) == 2.0
    a.rslora = True
    assert spec.scale(a) == 8.0  # alpha / sqrt(rank)
    assert spec.target_roles(parse({}).model.adapter) == tuple(spec.ROLES)  # all linear layers by default


@pytest.mark.parametrize("setting, message", [
    ({"targets": ["qkv"]}, "model.adapter.targets: ['qkv'] is not a list of roles; use all, or some of q, k, v"),
    ({"rank": 0}, "model.adapter.rank: must be >= 1"),
    ({"dropout": 1.0}, "model.adapter.dropout: must be in [0, 1)"),
    ({"trainable": ["lm_head"]}, "model.adapter.trainable: ['lm_head'] unknown; use some of embed, head, norms"),
    ({"dora": True, "_zero": 3}, "use parallel.zero_stage 0, 1 or 2"),
    ({"base_precision": "nf4"}, "nf4 (QLoRA) is not available in this version yet"),
])
def test_bad_adapter_settings_name_the_key_and_the_fix(setting, message):
    setting = dict(setting)
    zero = setting.pop("_zero", "auto")
    with pytest.raises(ConfigError, match=None) as e:
        parse({"model": {"adapter": {"type": "lora", **setting}}, "parallel": {"zero_stage": zero}})
    assert message in str(e.value)


def test_fused_projection_families_are_refused_until_their_shared_adapter_exists():
    with pytest.raises(ConfigError) as e:
        parse({"model": {"architecture": "Phi3ForCausalLM", "adapter": {"type": "lora"}}})
    assert "Phi3ForCausalLM fuses projections" in str(e.value) and "remove model.adapter" in str(e.value)


def test_the_cli_says_it_with_exit_2_and_writes_nothing(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAYSPEED_HOME": str(tmp_path),
           "PYTHONPATH": str(ROOT / "platform")}
    r = subprocess.run([sys.executable, "-m", "rayspeed", "plan", str(ROOT / "configs" / "tiny-cpu.yaml"), "--set",
                        "model.adapter.type=lora", "--set", "model.adapter.targets=[q, proj]"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "model.adapter.targets" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []
