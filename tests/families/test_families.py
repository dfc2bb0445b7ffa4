"""The model-family records and their registry: what each family says, the checkpoint name map, and that a new
family (one record) is read everywhere, including a head width other than hidden / heads."""

from __future__ import annotations

import dataclasses
import math

import pytest

from rayspeed import families
from rayspeed.config.hf_checkpoint import param_shapes
from rayspeed.config.hf_config import model_keys_from_hf, to_hf_config
from rayspeed.config.layout import Layout
from rayspeed.config.load import parse
from rayspeed.config.shape import ModelShape
from rayspeed.families.family import HEAD_DIM_KEY, SLIDING_USE_FLAG, ConfigKeys, Family
from rayspeed.planner.memory import layer_saved
from rayspeed.planner.search import build_ctx
from rayspeed.planner.timing import layer_fwd

SMALL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, vocab_size=256,
             seq_len=32, tie_embeddings=False)


def test_registry_finds_each_family_by_architecture_and_model_type():
    assert families.names() == ("DeepseekV3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                                "Glm4MoeForCausalLM", "GptOssForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                                "MixtralForCausalLM", "Olmo2ForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
                                "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    for fam in families.FAMILIES:
        assert families.by_architecture(fam.architecture) is fam
        assert families.by_model_type(fam.model_type) is fam
    assert [f.model_type for f in families.FAMILIES] == ["deepseek_v3", "gemma2", "gemma3_text", "glm4_moe", "gpt_oss",
                                                        "llama", "mistral", "mixtral", "olmo2", "phi3", "qwen2",
                                                        "qwen3", "qwen3_moe"]
    assert families.DEFAULT is families.by_architecture("LlamaForCausalLM")
    assert families.find("GPT2LMHeadModel") is None
    with pytest.raises(KeyError, match="supported: DeepseekV3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, "
                                      "Glm4MoeForCausalLM, GptOssForCausalLM, "
                                      "LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Olmo2ForCausalLM, "
                                      "Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM"):
        families.by_architecture("GPT2LMHeadModel")
    with pytest.raises(KeyError, match="gpt2"):
        families.by_model_type("gpt2")


def test_the_records_say_what_differs_between_families():
    (deepseek, gemma2, gemma3, glm, gpt_oss, llama, mistral, mixtral, olmo2, phi3, qwen2, qwen3,
     qwen3_moe) = families.FAMILIES
    assert [f.qkv_bias for f in families.FAMILIES] == [False, False, False, True, True] + [False] * 5 + [True, False,
                                                                                                      False]
    assert [f.tensor_names.qk_norm for f in families.FAMILIES] == [None, None, "head", "head", None, None, None, None,
                                                                   "projection", None, None, "head", "head"]
    assert [f.keys.reads("attn_logit_softcapping") for f in families.FAMILIES] == [False, True] + [False] * 11
    assert [f for f in families.FAMILIES if f.moe is not None] == [deepseek, glm, gpt_oss, mixtral, qwen3_moe]
    assert [f for f in families.FAMILIES if f.attention.params is not None] == [deepseek, glm]  # their own
    assert glm.layer_params is deepseek.layer_params  # DeepSeek-V3's mixture of experts
    assert [f for f in families.FAMILIES if f.attention.sinks] == [gpt_oss] and gpt_oss.stored is not None
    assert gpt_oss.keys.own == {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
    assert qwen3_moe.tensor_names.qk_norm == qwen3.tensor_names.qk_norm  # Qwen3's attention, q/k norms included
    assert [f.tensor_names.hidden_norms for f in families.FAMILIES] == [2, 4, 4] + [2] * 10
    assert [f.norms_keep_fp32 for f in families.FAMILIES] == [False, True, True, False, False, False, False, False,
                                                              True, False, False, False, False]
    assert [f.keys.sliding_window for f in families.FAMILIES] == ["none", "layer_types", "layer_types", "none",
                                                                  "layer_types", "none", "all_layers", "all_layers",
                                                                  "none", "all_layers", "use_flag", "use_flag",
                                                                  "use_flag"]
    # Data, no behaviour switches, at most 12 fields (what a family adds goes into a record: keys, attention).
    assert [len(dataclasses.fields(f)) for f in families.FAMILIES] == [12] * 13
    assert gemma2.tensor_names.in_layer.keys() < gemma3.tensor_names.in_layer.keys()  # Gemma 3 adds q/k norms
    # Phi-3's fused checkpoint tensors, each part's rows in order.
    assert phi3.tensor_names.fused_parts("model.layers.3.self_attn.qkv_proj.weight") == (
        "layers.3.attn.wq.weight", "layers.3.attn.wk.weight", "layers.3.attn.wv.weight")
    assert phi3.tensor_names.hf_name("layers.0.mlp.w_up.weight") == "model.layers.0.mlp.gate_up_proj.weight"
    assert phi3.tensor_names.fused_parts("model.layers.0.mlp.down_proj.weight") == ()
    assert phi3.keys.reads("partial_rotary_factor")
    assert (gemma3.keys.activation, gemma3.keys.activations, gemma3.keys.reads("rope_local_base_freq")) == (
        "hidden_activation", ("gelu_pytorch_tanh",), True)
    assert gemma3.tensor_names.hf_name("layers.2.mlp_post_norm.weight") == (
        "model.layers.2.post_feedforward_layernorm.weight")
    # OLMo 2's block keeps the decoder's norm names, mapped onto its post-norms.
    assert olmo2.tensor_names.hf_name("layers.0.attn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert olmo2.tensor_names.hf_name("layers.0.mlp_norm.weight") == "model.layers.0.post_feedforward_layernorm.weight"
    assert olmo2.tensor_names.partition_dim("layers.0.attn.q_norm.weight") == 0
    assert qwen3.head_dim(1024, 16, given=128) == 128 and qwen3.query_width(16, 128) == 2048  # config.json's
    for fam in (llama, mistral, qwen2):
        assert fam.keys.rope_types == ("default", "linear", "llama3", "yarn", "longrope")
        assert dict(fam.defaults) == {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "hidden_act": "silu"}
        assert fam.head_dim(4096, 32, given=256) == 128  # hidden / heads: config.json's head_dim is not read
        assert fam.query_width(32, 128) == 4096
    plain = ModelShape(**{**SMALL, "num_layers": 3})
    sliding = dataclasses.replace(plain, sliding_window=8, layer_types=("full_attention",) + ("sliding_attention",) * 2)
    assert llama.export_extras(plain) == {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    assert mistral.export_extras(plain) == {"sliding_window": None}
    assert qwen2.export_extras(plain) == {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 3,
                                          "layer_types": ["full_attention"] * 3}
    assert qwen2.export_extras(sliding) == {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
                                            "layer_types": ["full_attention"] + ["sliding_attention"] * 2}
    with pytest.raises(dataclasses.FrozenInstanceError):
        llama.qkv_bias = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        llama.tensor_names.in_layer["attn.wq.weight"] = ("x", 0)  # type: ignore[index]


def test_a_record_rayspeed_cannot_read_is_refused():
    with pytest.raises(ValueError, match="sliding_window 'sometimes'"):
        Family(architectures=("XForCausalLM",), model_type="x", keys=ConfigKeys(sliding_window="sometimes"))
    with pytest.raises(ValueError, match="activations"):
        Family(architectures=("XForCausalLM",), model_type="x", keys=ConfigKeys(activations=("relu",)))
    with pytest.raises(ValueError, match="optional keys"):
        Family(architectures=("XForCausalLM",), model_type="x", keys=ConfigKeys(optional=("rope_guess",)))
    assert Family(architectures=("XForCausalLM",), model_type="x", keys=ConfigKeys(optional=("head_dim",))).keys.reads(
        "head_dim")


def test_the_checkpoint_name_map_round_trips_with_each_tensors_tp_dim():
    names = families.by_architecture("Qwen2ForCausalLM").tensor_names
    shape = ModelShape(architecture="Qwen2ForCausalLM", qkv_bias=True, **SMALL)
    for name in param_shapes(shape):
        assert names.rayspeed_name(names.hf_name(name)) == name
    assert names.hf_name("layers.1.attn.wq.bias") == "model.layers.1.self_attn.q_proj.bias"
    assert names.hf_name("head.weight") == "lm_head.weight"
    assert names.rayspeed_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    assert names.rayspeed_name("model.layers.x.mlp.up_proj.weight") is None
    with pytest.raises(KeyError):
        names.hf_name("layers.0.attn.wz.weight")
    dims = {n: names.partition_dim(n) for n in ("embed.weight", "head.weight", "norm.weight",
                                                 "layers.0.attn.wq.weight", "layers.0.attn.wk.bias",
                                                 "layers.0.attn.wv.weight", "layers.0.attn.wo.weight",
                                                 "layers.0.attn.wo.bias", "layers.0.mlp.w_gate.weight",
                                                 "layers.0.mlp.w_up.weight", "layers.0.mlp.w_down.weight",
                                                 "layers.0.attn_norm.weight", "layers.0.mlp_norm.weight",
                                                 "layers.0.unknown.weight", "elsewhere")}
    assert dims == {"embed.weight": 0, "head.weight": 0, "norm.weight": None, "layers.0.attn.wq.weight": 0,
                    "layers.0.attn.wk.bias": 0, "layers.0.attn.wv.weight": 0, "layers.0.attn.wo.weight": 1,
                    "layers.0.attn.wo.bias": None, "layers.0.mlp.w_gate.weight": 0, "layers.0.mlp.w_up.weight": 0,
                    "layers.0.mlp.w_down.weight": 1, "layers.0.attn_norm.weight": None,
                    "layers.0.mlp_norm.weight": None, "layers.0.unknown.weight": None, "elsewhere": None}


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"])
def test_todays_families_keep_the_query_width_at_hidden(arch):
    shape = ModelShape.from_config(parse({"model": {"architecture": arch, "hidden_size": 256, "num_heads": 8,
                                                    "num_kv_heads": 2}}).model)
    assert shape.family is families.by_architecture(arch)
    assert (shape.head_dim, shape.q_dim, shape.kv_dim) == (32, 256, 64)
    assert shape.qkv_bias == (arch == "Qwen2ForCausalLM")


# A Qwen3-0.6B-like family: its config.json names head_dim 128 with hidden 1024 over 16 heads (not 64).
WIDE = Family(architectures=("WideHeadForCausalLM",), model_type="wide_head",
              keys=ConfigKeys(optional=(HEAD_DIM_KEY,), sliding_window=SLIDING_USE_FLAG))
WIDE_CONFIG = {"architectures": ["WideHeadForCausalLM"], "model_type": "wide_head", "hidden_size": 1024,
               "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
               "intermediate_size": 3072, "vocab_size": 151936, "max_position_embeddings": 4096}


@pytest.fixture
def wide_family(monkeypatch):
    monkeypatch.setattr(families, "FAMILIES", families.FAMILIES + (WIDE,))
    return WIDE


def test_a_new_family_is_one_record_read_by_the_config_the_checkpoint_and_the_export(wide_family):
    keys, problems = model_keys_from_hf(WIDE_CONFIG, "wide/config.json", seq_len=2048)
    assert problems == [] and keys["architecture"] == "WideHeadForCausalLM" and keys["head_dim"] == 128
    cfg = parse({"model": {**{k: v for k, v in keys.items() if v is not None}, "seq_len": 2048}})
    shape = ModelShape.from_config(cfg.model)
    assert (shape.family, shape.head_dim, shape.q_dim, shape.kv_dim) == (WIDE, 128, 2048, 1024)
    shapes = param_shapes(shape)
    assert shapes["layers.0.attn.wq.weight"] == (2048, 1024) and shapes["layers.0.attn.wo.weight"] == (1024, 2048)
    assert shapes["layers.0.attn.wk.weight"] == (1024, 1024)
    h, f = 1024, 3072
    assert shape.layer_matrix_params == 2 * h * 2048 + 2 * h * 1024 + 3 * h * f
    assert shape.layer_params * 4 + shape.embedding_params + shape.head_params + h == shape.params
    assert sum(math.prod(s) for s in shapes.values()) == shape.params
    out = to_hf_config(shape)
    assert (out["architectures"], out["model_type"], out["head_dim"]) == (["WideHeadForCausalLM"], "wide_head", 128)
    assert "use_sliding_window" not in out  # the record writes no extra keys


def test_the_planner_plans_a_head_width_other_than_hidden_over_heads(wide_family):
    job = {"model": {"architecture": "WideHeadForCausalLM", "hidden_size": 1024, "num_layers": 4, "num_heads": 16,
                     "num_kv_heads": 8, "head_dim": 128, "ffn_hidden_size": 3072, "vocab_size": 32000,
                     "seq_len": 2048}, "train": {"global_batch_size": 8}, "cluster": {"num_workers": 2,
                                                                                       "use_gpu": True}}
    wide = build_ctx(parse(job))
    narrow = build_ctx(parse({**job, "model": {**job["model"], "head_dim": None}}))
    assert (wide.shape.q_dim, narrow.shape.q_dim) == (2048, 1024)
    # q after RoPE and the SDPA output (2 q_dim), k and v as SDPA gets them (2 kv_dim on the flash path, else
    # expanded to 2 q_dim), RoPE's fp32 tables (2 x 2 x head_dim): per token, this much more.
    wide_a, narrow_a = (layer_saved(c.shape, 1, False, 2, 1, flash_gqa=True)[1] for c in (wide, narrow))
    assert wide_a - narrow_a == 2 * 1024 + 2 * 512 + 4 * 64
    wide_a, narrow_a = (layer_saved(c.shape, 1, False)[1] for c in (wide, narrow))
    assert wide_a - narrow_a == 2 * 1024 + 2 * 1024 + 4 * 64
    assert wide.shape.params - narrow.shape.params == 4 * (2 * 1024 * 1024 + 2 * 1024 * 512)
    assert wide.shape.flops_per_token > narrow.shape.flops_per_token
    lay = Layout(2, 1, 1, 1, 4, 1, False, "none")
    assert layer_fwd(wide, lay)[0] > layer_fwd(narrow, lay)[0]


def test_a_head_dim_a_family_does_not_read_is_a_problem_naming_the_key():
    from rayspeed.config.validate import check

    cfg = parse({"model": {"hidden_size": 256, "num_heads": 8}})
    cfg.model.head_dim = 64
    problems = check(cfg, lint_cluster_env=False)
    assert any(p.startswith("model.head_dim: 64 differs from hidden_size / num_heads = 32") for p in problems)
    cfg.model.head_dim = 32
    assert not any("head_dim" in p for p in check(cfg, lint_cluster_env=False))
