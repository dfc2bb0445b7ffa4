"""GLM-4.5 parity with transformers (Glm4MoeForCausalLM made locally: q/k/v biases, head_dim 16 beside hidden 32 /
4 heads, RoPE over half of each head, with and without per-head q/k norms, a dense first layer, eight routed experts
in two groups with the score correction and a shared expert), fp32, rtol = atol = 1e-5: logits, loss and every
gradient at tp1 and each rank's at tp2 with sequence parallelism; the export loads back with the same logits. Its
record and decoder are new files composing the shared attention and DeepSeek-V3's mixture of experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _dist import run_distributed
from _hf_models import shape_of
from _hf_parity import build as _build

TOL = dict(rtol=1e-5, atol=1e-5)
SEQ, BATCH = 16, 2
CONFIG = dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_shared_experts=1, n_routed_experts=8,
              num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.0,
              attention_bias=True, max_position_embeddings=64, tie_word_embeddings=False)
VARIANTS = {"qk-norm": {"use_qk_norm": True}, "no-qk-norm": {"use_qk_norm": False}}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def glm(request, tmp_path_factory):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(5)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**{**CONFIG, **VARIANTS[request.param]})).float()
    with torch.no_grad():  # routers far from ties; biases and norms away from their initial values
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            elif name.endswith(("bias", "norm.weight")):
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    assert model.config.rope_parameters.get("partial_rotary_factor", model.config.to_dict().get(
        "partial_rotary_factor")) == 0.5
    d = tmp_path_factory.mktemp(request.param) / "m"
    model.save_pretrained(d)
    ids = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    logits = model(ids[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"name": request.param, "dir": str(d), "ids": ids, "logits": logits.detach(), "loss": loss.detach(),
            "grads": grads}


def _shape(model_dir):
    return shape_of(model_dir, SEQ)


def _reference_grad(ref, shape, name, rank=0, world=1):
    i = name.split(".")[1]
    f, prefix = shape.expert_ffn_hidden_size, f"model.layers.{i}.mlp.experts."
    if name.endswith("mlp.w_gate"):
        whole, dim = ref["grads"][prefix + "gate_up_proj"][:, :f], 1
    elif name.endswith("mlp.w_up"):
        whole, dim = ref["grads"][prefix + "gate_up_proj"][:, f:], 1
    elif name.endswith("mlp.w_down"):
        whole, dim = ref["grads"][prefix + "down_proj"], 2
    else:
        names = shape.family.tensor_names
        whole, dim = ref["grads"][names.hf_name(name)], names.partition_dim(name)
    return whole if dim is None or world == 1 else whole.chunk(world, dim=dim)[rank]


def test_tp1_logits_loss_and_gradients_match_transformers(glm):
    shape = _shape(glm["dir"])
    assert (shape.partial_rotary_factor, shape.head_dim, shape.moe_layers, shape.router_aux_loss_coef) == (
        0.5, 16, (1, 2), 0.0)
    model = _build(shape, glm["dir"])
    assert sum(p.numel() for p in model.parameters()) == shape.params
    assert ("layers.0.attn.q_norm.weight" in dict(model.named_parameters())) == (glm["name"] == "qk-norm")
    ids = glm["ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:, :-1]), glm["logits"], **TOL)
    loss = model(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(loss.detach(), glm["loss"], **TOL)
    loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, _reference_grad(glm, shape, name), **TOL, msg=lambda m: f"{name}: {m}")


def _tp2_sp(rank, world, model_dir, ids):
    from rayspeed.parallel.groups import ParallelGroups

    model = _build(_shape(model_dir), model_dir, ParallelGroups(dp=1, tp=2, pp=1).tp, sp=True)
    with torch.no_grad():
        logits = model(ids[:, :-1])
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return logits, loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                   if p.grad is not None}


def test_tp2_with_sequence_parallelism_matches_transformers(glm):
    shape = _shape(glm["dir"])
    for rank, (logits, loss, grads) in enumerate(run_distributed(_tp2_sp, 2, glm["dir"], glm["ids"])):
        torch.testing.assert_close(logits, glm["logits"], **TOL)
        torch.testing.assert_close(loss, glm["loss"], **TOL)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, _reference_grad(glm, shape, name, rank, 2), **TOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


def test_the_export_loads_back_with_the_same_logits(glm, tmp_path):
    from transformers import AutoModelForCausalLM

    from rayspeed.model.hf_export import write_hf_dir

    shape = _shape(glm["dir"])
    write_hf_dir(_build(shape, glm["dir"]).full_state_dict(), shape, str(tmp_path / "out"))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert back.config.use_qk_norm == (glm["name"] == "qk-norm")
    with torch.no_grad():
        torch.testing.assert_close(back(glm["ids"][:, :-1]).logits, glm["logits"], **TOL)
