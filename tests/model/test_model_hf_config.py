"""model.pretrained: config.json read into the job's model section (torch-free), both RoPE forms, the explicit
key rule, and every bad input reported as one clear problem before anything runs (exit 2, nothing written)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _hf_models import QWEN, save

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny-pretrained-cpu.yaml")

# A Llama 3.1-style config.json as transformers 4 wrote it (rope_theta + rope_scaling), and the same model in
# transformers 5's form (rope_parameters).
V4 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
      "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "hidden_act": "silu",
      "rope_theta": 500000.0, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 256, "rope_type": "llama3"},
      "torch_dtype": "bfloat16", "transformers_version": "4.43.0"}


def _dir(tmp_path, name, cfg):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _parse(model_dir, *sets, model=None):
    from rayspeed.config.load import parse

    return parse({"model": {"seq_len": 64, **(model or {})}},
                 [f"model.pretrained={model_dir}", "model.init=random", *sets])


def _problems(model_dir, *sets, model=None):
    from rayspeed.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        _parse(model_dir, *sets, model=model)
    return e.value.problems


def test_transformers4_config_loads_to_the_same_shape_as_its_transformers5_form(tmp_path):
    from transformers import LlamaConfig

    from rayspeed.config.shape import ModelShape

    v4 = _dir(tmp_path, "v4", V4)
    v5_dir = tmp_path / "v5"
    LlamaConfig.from_pretrained(v4).save_pretrained(v5_dir)  # transformers 5 rewrites it in its own form
    v5 = json.loads((v5_dir / "config.json").read_text())
    assert "rope_parameters" in v5 and "rope_scaling" not in v5 and "rope_theta" not in v5
    a, b = ModelShape.from_config(_parse(v4).model), ModelShape.from_config(_parse(str(v5_dir)).model)
    assert a == b
    assert (a.rope_type, a.rope_factor, a.rope_original_max_positions, a.rope_theta) == ("llama3", 8.0, 256, 500000.0)
    assert (a.num_kv_heads, a.tie_embeddings, a.norm_eps, a.max_position_embeddings) == (2, True, 1e-5, 1024)


def test_old_rope_scaling_type_key_and_linear(tmp_path):
    cfg = dict(V4, rope_scaling={"type": "linear", "factor": 4.0})
    m = _parse(_dir(tmp_path, "lin", cfg)).model
    assert m.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_keys_not_set_come_from_config_json_and_set_ones_must_agree(tmp_path):
    d = _dir(tmp_path, "m", V4)
    m = _parse(d, "model.num_layers=2", model={"vocab_size": 256}).model
    assert (m.hidden_size, m.num_layers, m.ffn_hidden_size, m.architecture) == (64, 2, 128, "LlamaForCausalLM")
    problems = _problems(d, "model.hidden_size=128")
    assert len(problems) == 1 and "model.hidden_size" in problems[0] and "128" in problems[0] and "64" in problems[0]
    assert str(Path(d) / "config.json") in problems[0]
    problems = _problems(d, model={"tie_embeddings": False})
    assert "model.tie_embeddings" in problems[0] and "False" in problems[0] and "True" in problems[0]


def test_seq_len_is_a_job_key_bounded_by_max_positions(tmp_path):
    d = _dir(tmp_path, "m", dict(V4, max_position_embeddings=32))
    problems = _problems(d)
    assert any("model.seq_len (64)" in p and "max_position_embeddings (32)" in p for p in problems)


@pytest.mark.parametrize("change,needle", [
    ({"architectures": ["GPT2LMHeadModel"]},
     "architecture GPT2LMHeadModel is not supported; supported: DeepseekV3ForCausalLM, Gemma2ForCausalLM"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope type 'dynamic' is not supported"),
    ({"sliding_window": 32}, "sliding_window 32 (sliding-window attention) is not supported for LlamaForCausalLM"),
    ({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_act": None, "head_dim": 16,
      "final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0 (soft-capping) is not supported"),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
      "layer_types": ["sliding_attention"]}, "layer_types must give one of"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"head_dim": 32}, "head_dim 32"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_unsupported_models_are_named(tmp_path, change, needle):
    problems = _problems(_dir(tmp_path, "m", {**V4, **change}))
    assert len(problems) == 1 and needle in problems[0], problems
    assert "config.json" in problems[0]


def test_sliding_windows_are_read_as_transformers_reads_each_family(tmp_path):
    mistral = {**V4, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 32}
    m = _parse(_dir(tmp_path, "mistral", mistral)).model
    assert (m.sliding_window, m.layer_types) == (32, None)  # every layer
    qwen2 = {**V4, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "sliding_window": 16,
             "max_window_layers": 1}
    assert _parse(_dir(tmp_path, "off", qwen2)).model.sliding_window is None  # without use_sliding_window: none
    m = _parse(_dir(tmp_path, "on", {**qwen2, "use_sliding_window": True})).model
    assert (m.sliding_window, m.layer_types) == (16, ["full_attention", "sliding_attention"])
    # Gemma 3 without layer_types (transformers 4's files): every sliding_window_pattern-th layer is global; its
    # local layers' RoPE base and the global one's scaling from the old keys.
    gemma = {**V4, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 4,
             "head_dim": 16, "hidden_act": None, "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 8,
             "sliding_window_pattern": 2, "rope_local_base_freq": 10000.0, "rope_theta": 1e6,
             "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 168}
    m = _parse(_dir(tmp_path, "gemma", gemma)).model
    assert (m.sliding_window, m.layer_types) == (8, ["sliding_attention", "full_attention"] * 2)
    assert (m.rope_local_theta, m.rope_theta, m.rope_scaling, m.query_pre_attn_scalar, m.hidden_act) == (
        10000.0, 1e6, {"rope_type": "linear", "factor": 8.0}, 168.0, "gelu_pytorch_tanh")


def test_missing_directory_and_config(tmp_path):
    assert "no such directory" in _problems(str(tmp_path / "nope"))[0]
    (tmp_path / "empty").mkdir()
    assert "config.json is missing" in _problems(str(tmp_path / "empty"))[0]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("q") / "qwen"
    save(d, QWEN, shards=2)
    return d


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_weights_checked_from_headers(qwen_dir, tmp_path):
    from rayspeed.config.load import parse
    from rayspeed.errors import ConfigError

    ok = parse({"model": {"seq_len": 32}}, [f"model.pretrained={qwen_dir}"])
    assert ok.model.num_kv_heads == 2 and ok.model.init == "pretrained"

    def problems(d):
        with pytest.raises(ConfigError) as e:
            parse({"model": {"seq_len": 32}}, [f"model.pretrained={d}"])
        return e.value.problems

    missing = _copy(qwen_dir, tmp_path / "missing")
    shard = sorted(missing.glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert shard.name in problems(missing)[0] and "missing" in problems(missing)[0]

    cut = _copy(qwen_dir, tmp_path / "cut")
    shard = sorted(cut.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    assert shard.name in problems(cut)[0] and "cut short" in problems(cut)[0]

    wrong = _copy(qwen_dir, tmp_path / "wrong")
    cfg = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=96)))
    p = problems(wrong)
    assert "disagree with config.json" in p[0] and "mlp.gate_proj.weight is (64, 32)" in p[0] and "(96, 32)" in p[0]

    none = tmp_path / "none"
    none.mkdir()
    (none / "config.json").write_text((qwen_dir / "config.json").read_text())
    assert "no model.safetensors" in problems(none)[0] and "model.init: random" in problems(none)[0]
    # random init needs no weights
    assert parse({"model": {"seq_len": 32}}, [f"model.pretrained={none}", "model.init=random"]).model.hidden_size == 32


def test_tokenizer_larger_than_the_vocabulary(qwen_dir, tmp_path):
    from tokenizers import Tokenizer, models

    from rayspeed.config.hf_checkpoint import tokenizer_problems, tokenizer_size

    d = _copy(qwen_dir, tmp_path / "tok")
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0")).save(str(d / "tokenizer.json"))
    assert tokenizer_size(d) == 300
    p = tokenizer_problems(d, 256)
    assert len(p) == 1 and "300 ids" in p[0] and "256" in p[0] and "tokenizer.json" in p[0]
    assert tokenizer_problems(d, 300) == []
    assert "no tokenizer.json" in tokenizer_problems(qwen_dir, 256)[0]


def test_plan_reads_a_real_model_without_torch(qwen_dir):
    code = ("import sys, json; from rayspeed.cli import main; "
            f"rc = main(['plan', '{TINY}', '--json', '--set', 'model.pretrained={qwen_dir}', '--set', "
            "'model.seq_len=32']); "
            "assert rc == 0; bad = [m for m in ('torch', 'deepspeed', 'ray', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "platform")})
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["plan"]["fits"]


def test_bad_checkpoint_exits_2_before_anything_is_written(qwen_dir, tmp_path):
    d = _copy(qwen_dir, tmp_path / "bad")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, architectures=["FalconForCausalLM"])))
    home = tmp_path / "home"
    home.mkdir()
    r = subprocess.run([sys.executable, str(ROOT / "jobs" / "train.py"), "--config", TINY, "--set",
                        f"model.pretrained={d}", "--set", "model.seq_len=32"], capture_output=True, text=True,
                       timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "platform"), "RAYSPEED_HOME": str(home)},
                       cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "FalconForCausalLM is not supported" in r.stderr
    assert list(home.iterdir()) == []  # no mlflow.db, no runs/


def test_hub_id_resolves_through_the_huggingface_cache(qwen_dir, tmp_path):
    """A hub id goes to huggingface_hub exactly as users pass it; here its cache is pre-filled and the hub is
    offline (HF_HUB_OFFLINE), the way a machine without network reuses earlier downloads."""
    import shutil

    rev = "0" * 40
    repo = tmp_path / "hub" / "models--tiny-org--tiny-qwen"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    shutil.copytree(qwen_dir, repo / "snapshots" / rev)
    code = ("from rayspeed.config.load import parse; from rayspeed.model.hf_weights import local_model_dir; "
            "c = parse({'model': {'seq_len': 32}}, ['model.pretrained=tiny-org/tiny-qwen']); "
            "print(c.model.architecture, c.model.num_kv_heads, local_model_dir('tiny-org/tiny-qwen'))")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform"), "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    arch, kv, snapshot = r.stdout.split()
    assert (arch, kv) == ("Qwen2ForCausalLM", "2") and snapshot.endswith(f"snapshots/{rev}")
    r = subprocess.run([sys.executable, "-c", code.replace("tiny-org/tiny-qwen", "tiny-org/absent", 1)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0
    assert "config.json is not in the local Hugging Face cache and HF_HUB_OFFLINE is set" in r.stderr
