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
                                                        "rslora", "dora", "base_precision", "double_quant",
                                                        "lora_plus_ratio", "rank_pattern", "alpha_pattern",
                                                        "compute_dtype")}
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
    ({"base_precision": "nf4", "_zero": 3}, "nf4 packs the base weights in 4 bits, which ZeRO-3 does not partition; "
                                            "use parallel.zero_stage 0, 1 or 2"),
    ({"targets": ["q", "v"], "rank_pattern": {"k": 8}}, "model.adapter.rank_pattern: ['k'] are not among the "
                                                        "targeted roles (q, v)"),
    ({"alpha_pattern": {"q": 0}}, "model.adapter.alpha_pattern: {'q': 0.0} must be > 0"),
    ({"compute_dtype": "bf16"}, "model.adapter.compute_dtype: bf16 applies to 4-bit base weights only"),
])
def test_bad_adapter_settings_name_the_key_and_the_fix(setting, message):
    setting = dict(setting)
    zero = setting.pop("_zero", "auto")
    with pytest.raises(ConfigError, match=None) as e:
        parse({"model": {"adapter": {"type": "lora", **setting}}, "parallel": {"zero_stage": zero}})
    assert message in str(e.value)


def test_a_fused_projection_is_targeted_whole_with_one_rank():
    """Phi-3's qkv_proj and gate_up_proj carry one adapter each: all of their roles or none, one rank and alpha."""
    phi3 = {"architecture": "Phi3ForCausalLM"}
    parse({"model": {**phi3, "adapter": {"type": "lora"}}})
    parse({"model": {**phi3, "adapter": {"type": "lora", "targets": ["q", "k", "v", "down"],
                                         "rank_pattern": {"q": 8, "k": 8, "v": 8}}}})
    with pytest.raises(ConfigError) as e:
        parse({"model": {**phi3, "adapter": {"type": "lora", "targets": ["q", "v", "gate"],
                                             "alpha_pattern": {"q": 4.0}}}})
    msg = str(e.value)
    assert "model.adapter.targets: Phi3ForCausalLM fuses q, k, v in one projection (qkv_proj)" in msg
    assert "target all of gate, up or none" in msg
    assert "model.adapter.alpha_pattern: {'q': 4.0, 'k': None, 'v': None} differ within qkv_proj" in msg


def test_the_cli_says_it_with_exit_2_and_writes_nothing(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAYSPEED_HOME": str(tmp_path),
           "PYTHONPATH": str(ROOT / "platform")}
    r = subprocess.run([sys.executable, "-m", "rayspeed", "plan", str(ROOT / "configs" / "tiny-cpu.yaml"), "--set",
                        "model.adapter.type=lora", "--set", "model.adapter.targets=[q, proj]"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "model.adapter.targets" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_lora_plus_gives_every_b_its_own_learning_rate_through_the_schedule():
    """LoRA+ (peft's create_loraplus_optimizer: lr_B = lr x ratio): Adam's first step moves each B ratio times as
    far as with one learning rate, and A as far; the schedule keeps the ratio."""
    import torch

    from rayspeed.adapters.attach import add_adapters
    from rayspeed.config.shape import ModelShape
    from rayspeed.engine.optim import build_optimizer, build_scheduler
    from rayspeed.model.transformer import Transformer

    def one_step(ratio):
        cfg = parse({"model": {"hidden_size": 32, "num_layers": 1, "num_heads": 4, "vocab_size": 256,
                               "adapter": {"type": "lora", "rank": 4, "lora_plus_ratio": ratio}},
                     "train": {"lr": 1e-3, "warmup_steps": 0, "max_steps": 10}})
        model = Transformer(ModelShape.from_config(cfg.model))
        add_adapters(model, cfg.model.adapter, seed=1)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        opt = build_optimizer(model, cfg, on_gpu=False)
        sched = build_scheduler(opt, cfg)
        ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
        model(ids[:, :-1], ids[:, 1:]).backward()
        opt.step()
        sched.step()
        lrs = sorted({g["lr"] for g in opt.param_groups})
        return {n: p.detach() - before[n] for n, p in model.named_parameters() if p.requires_grad}, lrs

    plain, lrs_plain = one_step(0.0)
    plus, lrs_plus = one_step(16.0)
    assert len(lrs_plain) == 1 and lrs_plus == pytest.approx([lrs_plain[0], 16 * lrs_plain[0]])
    for name, d in plain.items():
        want = d * 16 if name.endswith("lora_B") else d
        torch.testing.assert_close(plus[name], want, rtol=1e-5, atol=1e-9, msg=lambda m: f"{name}: {m}")
    assert any(d.abs().max() > 0 for n, d in plain.items() if n.endswith("lora_B"))


def test_a_qlora_launch_without_base_weights_is_exit_2_and_writes_nothing(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAYSPEED_HOME": str(tmp_path),
           "PYTHONPATH": str(ROOT / "platform")}
    r = subprocess.run([sys.executable, str(ROOT / "jobs" / "train.py"), "--config", str(ROOT / "configs" /
                        "tiny-cpu.yaml"), "--launcher", "local", "--set", "model.adapter.type=lora", "--set",
                        "model.adapter.base_precision=nf4"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "model.adapter.base_precision: nf4 quantizes pretrained base weights; set model.pretrained" in r.stderr
    assert list(tmp_path.iterdir()) == []
