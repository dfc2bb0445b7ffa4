"""Mixture-of-experts parity with transformers at ep1 (Qwen3MoeForCausalLM with a dense layer among the sparse
ones, and MixtralForCausalLM, made locally), fp32, rtol = atol = 1e-5: logits, the language-model loss plus the
pooled load-balancing loss (output_router_logits on), and every parameter's gradient; the export writes the hub's
per-expert layout, which transformers loads back to the same logits. The test tokens' top-k router margins exceed
1e-4 (routing is discontinuous: a nearer tie could route differently under another summation order)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

TOL = dict(rtol=1e-5, atol=1e-5)
SEQ, BATCH = 16, 2
COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, router_aux_loss_coef=0.02,
              output_router_logits=True)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                       norm_topk_prob=False, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
}


def _ids(vocab, seed):
    return torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def _margin(router_logits) -> float:
    """The smallest gap between a token's k-th and (k+1)-th router logits (softmax keeps their order)."""
    top = torch.topk(router_logits.detach().float(), 3, dim=-1).values
    return float((top[:, 1] - top[:, 2]).min())


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    import transformers

    config_cls, model_cls, extra = FAMILIES[request.param]
    torch.manual_seed(3)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra)).float()
    with torch.no_grad():  # routers far from ties: the top-k margins below are checked
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    d = tmp_path_factory.mktemp(request.param) / "m"
    model.save_pretrained(d)
    for seed in range(100):  # the first tokens whose k-th and (k+1)-th router logits are 1e-4 apart
        ids = _ids(COMMON["vocab_size"], seed)
        out = model(ids[:, :-1], output_router_logits=True)
        if min(_margin(logits) for logits in out.router_logits) > 1e-4:
            break
    assert min(_margin(logits) for logits in out.router_logits) > 1e-4
    ce = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss = ce + COMMON["router_aux_loss_coef"] * out.aux_loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"name": request.param, "dir": str(d), "ids": ids, "logits": out.logits.detach(), "loss": loss.detach(),
            "aux": out.aux_loss.detach(), "grads": grads}


def _shape(model_dir):
    from types import SimpleNamespace

    from rayspeed import families
    from rayspeed.config.hf_config import model_keys_from_hf, read_pretrained_config
    from rayspeed.config.moe_keys import aux_coef_from_hf
    from rayspeed.config.shape import ModelShape

    hf, path = read_pretrained_config(model_dir)
    keys, problems = model_keys_from_hf(hf, str(path), seq_len=SEQ)
    assert not problems
    coef = aux_coef_from_hf(families.by_architecture(keys["architecture"]), hf)
    return ModelShape.from_config(SimpleNamespace(**keys, seq_len=SEQ, router_aux_loss_coef=coef))


def _build(shape, model_dir):
    from rayspeed.model.hf_weights import load_hf_weights
    from rayspeed.model.transformer import Transformer
    from rayspeed.parallel.layers import deferred_init

    with deferred_init():
        model = Transformer(shape)
    load_hf_weights(model, model_dir, shape)
    return model


def _reference_grad(ref, shape, name):
    """transformers' gradient of rayspeed parameter `name` (its in-memory experts are fused: gate_up, down)."""
    i = name.split(".")[1]
    prefix = f"model.layers.{i}.mlp."
    if name.endswith("mlp.router.weight"):
        return ref["grads"][prefix + "gate.weight"]
    f = shape.expert_ffn_hidden_size
    if name.endswith("mlp.w_gate"):
        return ref["grads"][prefix + "experts.gate_up_proj"][:, :f]
    if name.endswith("mlp.w_up"):
        return ref["grads"][prefix + "experts.gate_up_proj"][:, f:]
    if name.endswith("mlp.w_down"):
        return ref["grads"][prefix + "experts.down_proj"]
    return ref["grads"][shape.family.tensor_names.hf_name(name)]


def test_the_shape_counts_every_expert_and_the_flops_the_active_ones(family):
    shape = _shape(family["dir"])
    model = _build(shape, family["dir"])
    assert sum(p.numel() for p in model.parameters()) == shape.params
    assert shape.inactive_params == len(shape.moe_layers) * (shape.num_experts - 2) * shape.expert_params
    if family["name"] == "qwen3_moe":
        assert shape.moe_layers == (0, 2) and not shape.norm_topk_prob and shape.expert_ffn_hidden_size == 24


def test_logits_loss_aux_loss_and_gradients_match_transformers(family):
    shape = _shape(family["dir"])
    model = _build(shape, family["dir"])
    ids = family["ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:, :-1]), family["logits"], **TOL)
    torch.testing.assert_close(model.aux_loss, family["aux"], **TOL)
    loss = model(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(loss.detach(), family["loss"], **TOL)
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, _reference_grad(family, shape, name), **TOL, msg=lambda m: f"{name}: {m}")


def test_the_export_is_the_hub_layout_and_loads_to_the_same_logits(family, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from rayspeed.model.hf_export import write_hf_dir

    shape = _shape(family["dir"])
    model = _build(shape, family["dir"])
    write_hf_dir(model.full_state_dict(), shape, str(tmp_path / "out"))
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f, \
            safe_open(str(family["dir"]) + "/model.safetensors", "pt") as g:
        assert set(f.keys()) == set(g.keys())  # per-expert names, as save_pretrained writes them
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(family["ids"][:, :-1]).logits, family["logits"], **TOL)


def test_unsupported_moe_architectures_are_named_with_the_reason():
    from rayspeed.config.hf_config import model_keys_from_hf

    for arch, word in (("DeepseekV2ForCausalLM", "softmax routing"), ("Qwen3NextForCausalLM", "hybrid attention")):
        _, problems = model_keys_from_hf({"architectures": [arch]}, "config.json")
        assert len(problems) == 1 and word in problems[0] and arch in problems[0]


def test_recomputed_blocks_give_the_same_loss_and_gradients():
    """The routers' statistics are recorded in the forward only: a block recomputed in backward (selective or full
    checkpointing) neither records them twice nor loses the balance loss's gradient."""
    from types import SimpleNamespace

    from rayspeed.config.shape import ModelShape
    from rayspeed.model.transformer import Transformer

    shape = ModelShape.from_config(SimpleNamespace(
        architecture="MixtralForCausalLM", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        ffn_hidden_size=48, vocab_size=64, seq_len=SEQ, tie_embeddings=False, num_experts=4, experts_per_token=2,
        router_aux_loss_coef=0.5))
    ids = _ids(64, 1)
    runs = {}
    for mode in ("none", "selective", "full"):
        model = Transformer(shape, activation_checkpointing=mode, seed=3)
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        runs[mode] = (loss.detach(), model.aux_loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    for mode in ("selective", "full"):
        torch.testing.assert_close(runs[mode][0], runs["none"][0], **TOL)
        torch.testing.assert_close(runs[mode][1], runs["none"][1], **TOL)
        for name, grad in runs["none"][2].items():
            torch.testing.assert_close(runs[mode][2][name], grad, **TOL, msg=lambda m: f"{mode} {name}: {m}")


def test_a_frozen_router_keeps_its_weights_and_the_experts_train():
    """model.freeze_router: the routers take no gradient (the experts and the rest still do); without experts the
    key is refused, naming it."""
    from rayspeed.config.load import parse
    from rayspeed.config.shape import ModelShape
    from rayspeed.engine.transforms import apply_transforms
    from rayspeed.errors import ConfigError
    from rayspeed.model.moe import MoE
    from rayspeed.model.transformer import Transformer

    model_keys = dict(architecture="MixtralForCausalLM", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      ffn_hidden_size=48, vocab_size=256, seq_len=SEQ, num_experts=4, freeze_router=True)
    parallel = {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 0, "sequence_parallel": False,
                "activation_checkpointing": "none"}
    cfg = parse({"name": "t", "model": model_keys, "parallel": parallel, "cluster": {"num_workers": 1}})
    model = Transformer(ModelShape.from_config(cfg.model), seed=3)
    assert ("router_freeze", "2 routers frozen") in apply_transforms(model, cfg, None, on_gpu=False)
    ids = _ids(256, 2)
    model(ids[:, :-1], ids[:, 1:]).backward()
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    assert all(m.router.weight.grad is None and not m.router.weight.requires_grad for m in moe)
    assert all(m.w_gate.grad is not None and m.w_gate.grad.abs().sum() > 0 for m in moe)

    with pytest.raises(ConfigError) as refused:
        parse({"name": "t", "model": {**model_keys, "architecture": "LlamaForCausalLM", "num_experts": 0},
               "parallel": parallel, "cluster": {"num_workers": 1}})
    assert "model.freeze_router: true needs a mixture of experts" in str(refused.value)
