"""LoRA on a mixture of experts, against peft on transformers' model with the same adapter weights (fp32, rtol = atol
= 1e-5): `all` adapts the attention of every block; the experts, routers and Qwen3-MoE's dense MLP block stay
frozen (peft maps the MLP roles of a MoE model onto its experts: config.adapter). Logits, the language loss plus
the balance loss (output_router_logits on: its gradient reaches the attention adapters through the routers'
inputs) and every adapter gradient; the planner's adapter count is the built model's; MLP targets and QLoRA on
experts are refused naming the key. The test tokens' top-k router margins on the adapted model exceed 1e-4."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_moe_parity import COMMON, FAMILIES, TOL, _build, _ids, _margin, _shape


def randomize_b(model) -> None:
    """Every lora_B from N(0, 0.1) (B starts at zero: its gradients alone would not see A)."""
    from rayspeed.adapters.lora import LoraAdapter
    from rayspeed.parallel.layers import full_normal

    for m in model.modules():
        if isinstance(m, LoraAdapter):
            m.lora_B.data.copy_(full_normal((m.out_features, m.rank), 0.1, 7, m.name))


def _saved_key(name: str) -> str:
    """peft's parameter name -> its key in adapter_model.safetensors (the adapter name dropped)."""
    return name.replace(".default.", ".")


def _adapter():
    from rayspeed.config.schema import AdapterConfig

    return AdapterConfig(type="lora", rank=4, alpha=8.0, targets=["all"])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe(request, tmp_path_factory):
    import transformers

    config_cls, model_cls, extra = FAMILIES[request.param]
    torch.manual_seed(3)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra)).float()
    with torch.no_grad():  # routers far from ties
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    d = tmp_path_factory.mktemp(request.param) / "m"
    model.save_pretrained(d)
    return request.param, str(d)


def _peft(model_dir, state, adapter, shape):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from rayspeed.adapters import peft_files

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(hf, LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha,
                                         target_modules=peft_files.target_modules(adapter, shape)))
    assert not set_peft_model_state_dict(peft, peft_files.peft_state(state, shape)).unexpected_keys
    return peft


def test_lora_on_a_mixture_of_experts_matches_peft(moe):
    from rayspeed.adapters import peft_files
    from rayspeed.adapters.attach import add_adapters
    from rayspeed.config import adapter as spec

    name, model_dir = moe
    shape, adapter = _shape(model_dir), _adapter()
    model = _build(shape, model_dir)
    adapted = add_adapters(model, adapter, seed=1)
    randomize_b(model)
    dense = [i for i in range(shape.num_layers) if not shape.is_moe(i)]
    assert dense == ([1] if name == "qwen3_moe" else [])
    assert sorted(adapted) == sorted(f"layers.{i}.attn.{w}" for i in range(shape.num_layers)
                                     for w in ("wq", "wk", "wv", "wo"))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trained == spec.adapter_params(shape, adapter)  # the planner's count
    peft = _peft(model_dir, model.full_state_dict(), adapter, shape)
    assert peft_files.target_modules(adapter, shape) == ["q_proj", "k_proj", "v_proj", "o_proj"]

    for seed in range(100):  # the first tokens whose k-th and (k+1)-th router logits are 1e-4 apart, adapted
        ids = _ids(COMMON["vocab_size"], seed)
        with torch.no_grad():
            out = peft(ids[:, :-1], output_router_logits=True)
        if min(_margin(logits) for logits in out.router_logits) > 1e-4:
            break
    assert min(_margin(logits) for logits in out.router_logits) > 1e-4
    out = peft(ids[:, :-1], output_router_logits=True)
    ce = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), ids[:, 1:].reshape(-1))
    want = ce + COMMON["router_aux_loss_coef"] * out.aux_loss
    want.backward()
    ref = {_saved_key(n): p.grad for n, p in peft.named_parameters() if p.requires_grad}

    with torch.no_grad():
        torch.testing.assert_close(model(ids[:, :-1]), out.logits.detach(), **TOL)
    loss = model(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(loss.detach(), want.detach(), **TOL)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and len(grads) == len(ref) and all(peft_files.is_adapter(n) for n in grads)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref[peft_files.peft_key(n, shape)], **TOL, msg=lambda m: f"{n}: {m}")
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)  # experts, routers: frozen


def test_mlp_targets_and_qlora_on_experts_are_refused_naming_the_key():
    from rayspeed.config.load import parse
    from rayspeed.errors import ConfigError

    model = dict(architecture="MixtralForCausalLM", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                 ffn_hidden_size=48, vocab_size=256, seq_len=16, num_experts=4)
    job = {"name": "t", "cluster": {"num_workers": 1}, "parallel": {"zero_stage": 2}}
    lora = parse({**job, "model": {**model, "adapter": {"type": "lora"}}})
    assert lora.model.adapter.type == "lora"
    for adapter, said in (({"base_precision": "nf4"}, "model.adapter.base_precision: nf4 on a mixture of experts"),
                          ({"targets": ["q", "up"]}, "model.adapter.targets: up on a mixture of experts")):
        with pytest.raises(ConfigError) as refused:
            parse({**job, "model": {**model, "adapter": {"type": "lora", **adapter}}})
        assert said in str(refused.value), str(refused.value)
