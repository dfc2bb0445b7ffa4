"""The seams the next families need exist: a test-only family with an attention sink (gpt-oss), a sigmoid router
(DeepSeek-V3's scoring) and an image input stage (vision-language models) is its record and its composition of
parts, here, without a line of it in the platform. What each part computes is checked against plain math written
out here: the sink's softmax over [scores, sink], the routing against a loop over experts, the image stage's
projected features at the image tokens' places."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from rayspeed import families
from rayspeed.config.shape import ModelShape
from rayspeed.families.family import Family, TensorNames, frozen, llama_tensor_names
from rayspeed.model import families as model_families
from rayspeed.model.moe import MoE
from rayspeed.model.parts.blocks import Block
from rayspeed.model.parts.input_stage import TokenInput
from rayspeed.model.parts.self_attention import SinkAttention
from rayspeed.model.routers import SigmoidTopK
from rayspeed.model.transformer import Transformer

IMAGE_TOKEN, FEATURES = 7, 12


def toy_tensor_names() -> TensorNames:
    base = llama_tensor_names()
    in_layer = {**base.in_layer, "attn.sinks": ("self_attn.sinks", 0), "mlp.router.weight": ("mlp.router.weight", None)}
    top = {**base.top, "embed.projector.weight": ("multi_modal_projector.weight", None)}
    return TensorNames(top=frozen(top), in_layer=frozen(in_layer))


TOY = Family(architectures=("ToyForCausalLM",), model_type="toy", tensor_names=toy_tensor_names())


class SigmoidMoE(MoE):
    routing_rule = SigmoidTopK


class ToyBlock(Block):
    attention_class = SinkAttention
    moe_class = SigmoidMoE


class ImageInput(TokenInput):
    """Token embeddings, with the projected image features at the image tokens' places."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.projector = nn.Linear(FEATURES, self.embedding_dim, bias=False)

    def forward(self, input_ids: torch.Tensor, image_features: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = super().forward(input_ids)
        if image_features is None:
            return x
        at = input_ids == IMAGE_TOKEN
        return x.masked_scatter(at.unsqueeze(-1), self.projector(image_features).to(x.dtype))


TOY_MODEL = model_families.Composition(families=(TOY,), block=ToyBlock, input_stage=ImageInput)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(families, "FAMILIES", families.FAMILIES + (TOY,))
    found = model_families.compositions()
    monkeypatch.setattr(model_families, "compositions", lambda: found + (TOY_MODEL,))
    return ModelShape(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=48, vocab_size=64,
                      seq_len=10, tie_embeddings=False, architecture="ToyForCausalLM", num_experts=4,
                      experts_per_token=2, expert_ffn_hidden_size=24, moe_layers=(1,))


def test_the_toy_family_is_built_from_parts_and_trains(toy):
    torch.manual_seed(0)
    model = Transformer(toy, seed=3)
    names = {n for n, _ in model.named_parameters()}
    assert {"embed.projector.weight", "layers.0.attn.sinks", "layers.1.mlp.router.weight"} <= names
    assert isinstance(model.layers[1].mlp.rule, SigmoidTopK) and isinstance(model.layers[0].attn, SinkAttention)
    ids = torch.randint(0, 64, (2, 10))
    ids[:, 2:4] = IMAGE_TOKEN
    features = torch.randn(4, FEATURES)
    out = model(ids[:, :-1], ids[:, 1:], parts=True, inputs={"image_features": features})
    out.loss.backward()
    for name in ("embed.projector.weight", "layers.0.attn.sinks", "layers.1.mlp.router.weight"):
        assert dict(model.named_parameters())[name].grad.abs().sum() > 0, name
    assert out.balance is not None and out.aux is not None  # the routing is pooled into a balance term
    other = model(ids[:, :-1], ids[:, 1:], inputs={"image_features": features + 1})
    assert not torch.allclose(other, out.loss)  # the images reach the loss


def test_the_sink_attention_is_the_softmax_over_the_scores_and_the_sink(toy):
    attn = Transformer(toy, seed=3).layers[0].attn
    b, s, d = 2, 6, attn.head_dim
    q, k, v = torch.randn(b, 4, s, d), torch.randn(b, 2, s, d), torch.randn(b, 2, s, d)
    with torch.no_grad():
        attn.sinks.copy_(torch.tensor([-1.0, 0.0, 0.5, 2.0]))
    got = attn.core(q, k, v, None)
    ke, ve = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ ke.transpose(-1, -2)) * d ** -0.5
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    weights = scores.exp() / (scores.exp().sum(-1, keepdim=True) + attn.sinks.view(1, 4, 1, 1).exp())
    torch.testing.assert_close(got, weights @ ve, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        attn.sinks.fill_(-1e4)  # no sink: plain causal attention
    torch.testing.assert_close(attn.core(q, k, v, None), F.scaled_dot_product_attention(q, ke, ve, is_causal=True),
                               rtol=1e-5, atol=1e-5)


def test_the_sigmoid_router_routes_as_a_loop_over_experts_says(toy):
    moe = Transformer(toy, seed=3).layers[1].mlp
    x = torch.randn(5, 32)
    scores = torch.sigmoid(x @ moe.router.weight.T)
    top, chosen = scores.topk(2, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    want = torch.zeros_like(x)
    for t in range(5):
        for w, e in zip(top[t], chosen[t]):
            h = F.silu(x[t] @ moe.w_gate[e].T) * (x[t] @ moe.w_up[e].T)
            want[t] += w * (h @ moe.w_down[e].T)
    torch.testing.assert_close(moe(x.unsqueeze(0)).squeeze(0), want, rtol=1e-5, atol=1e-5)


def test_the_image_stage_writes_the_projected_features_at_the_image_tokens(toy):
    stage = Transformer(toy, seed=3).embed
    ids = torch.tensor([[1, IMAGE_TOKEN, IMAGE_TOKEN, 4]])
    features = torch.randn(2, FEATURES)
    out = stage(ids, image_features=features)
    torch.testing.assert_close(out[0, 1:3], stage.projector(features))
    torch.testing.assert_close(out[0, [0, 3]], stage.weight[[1, 4]])
    with pytest.raises(TypeError, match="token ids only"):
        TokenInput(64, 32, name="embed", init_std=0.02, seed=0)(ids, image_features=features)
