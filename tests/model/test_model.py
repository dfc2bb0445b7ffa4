"""The single-process Transformer: shapes, init, GQA, tying, chunked loss, checkpointing, training."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from rayspeed.config.shape import ModelShape
from rayspeed.model import Transformer, count_parameters, num_parameters, parameter_bytes
from rayspeed.parallel.layers import full_normal
from rayspeed.parallel.loss import chunked_linear_cross_entropy

torch.set_num_threads(1)


def make_cfg(**overrides):
    base = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                vocab_size=256, seq_len=16, tie_embeddings=True)
    base.update(overrides)
    return SimpleNamespace(**base)


def batch(cfg, b=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=gen)
    return ids, labels


def test_shapes_and_loss_dtype():
    cfg = make_cfg()
    model = Transformer(cfg, seed=1)
    ids, labels = batch(cfg)
    assert model(ids).shape == (2, cfg.seq_len, cfg.vocab_size)
    loss = model(ids, labels)
    assert loss.shape == () and loss.dtype == torch.float32


def test_initial_loss_is_uniform_guess():
    cfg = make_cfg()
    model = Transformer(cfg, seed=1)
    ids, labels = batch(cfg, b=4)
    with torch.no_grad():
        loss = model(ids, labels)
    assert abs(loss.item() - math.log(256)) < 0.1


@pytest.mark.parametrize("kv", [1, 2, 4])
def test_grouped_query_attention(kv):
    cfg = make_cfg(num_kv_heads=kv)
    model = Transformer(cfg, seed=1)
    assert model.layers[0].attn.wk.weight.shape == (kv * 16, 64)
    ids, labels = batch(cfg)
    model(ids, labels).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_attention_is_causal():
    cfg = make_cfg()
    model = Transformer(cfg, seed=1)
    ids, _ = batch(cfg)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_invalid_head_config():
    with pytest.raises(ValueError, match="num_heads=4 must divide by num_kv_heads=3"):
        Transformer(make_cfg(num_kv_heads=3))
    with pytest.raises(ValueError, match="activation_checkpointing"):
        Transformer(make_cfg(), activation_checkpointing="some")


def test_tied_embeddings_share_storage():
    tied = Transformer(make_cfg(tie_embeddings=True), seed=1)
    assert tied.head.weight is tied.embed.weight
    assert tied.head.weight.data_ptr() == tied.embed.weight.data_ptr()
    untied = Transformer(make_cfg(tie_embeddings=False), seed=1)
    assert untied.head.weight.data_ptr() != untied.embed.weight.data_ptr()
    assert num_parameters(untied) - num_parameters(tied) == 256 * 64


@pytest.mark.parametrize("chunk", [7, None])
def test_chunked_cross_entropy_equals_plain(chunk):
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 10, 32, generator=gen)
    weight = torch.randn(100, 32, generator=gen)
    labels = torch.randint(0, 100, (3, 10), generator=gen)
    labels[0, :4] = -100

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy((h1 @ w1.t()).reshape(-1, 100), labels.reshape(-1), ignore_index=-100)
    ref.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = chunked_linear_cross_entropy(h2, w2, labels, chunk_tokens=chunk)
    loss.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(h2.grad, h1.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w2.grad, w1.grad, atol=1e-6, rtol=1e-5)


def test_model_loss_is_chunked_and_matches_full_logits():
    cfg = make_cfg()
    model = Transformer(cfg, seed=2, loss_chunk_tokens=5)  # 32 tokens -> 7 chunks
    ids, labels = batch(cfg)
    loss = model(ids, labels)
    ref = F.cross_entropy(model(ids).reshape(-1, cfg.vocab_size), labels.reshape(-1))
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)


def _loss_and_grads(mode):
    cfg = make_cfg()
    model = Transformer(cfg, activation_checkpointing=mode, seed=4)
    ids, labels = batch(cfg)
    loss = model(ids, labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_checkpointing_modes_match():
    ref_loss, ref_grads = _loss_and_grads("none")
    for mode in ("selective", "full"):
        loss, grads = _loss_and_grads(mode)
        torch.testing.assert_close(loss, ref_loss, atol=0, rtol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], atol=1e-7, rtol=1e-6, msg=f"{mode}: {name}")


def test_adamw_reduces_loss():
    cfg = make_cfg()
    model = Transformer(cfg, seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids, labels = batch(cfg)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = model(ids, labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("tied,kv", [(True, 2), (False, 4), (False, 1)])
def test_parameter_count_formula(tied, kv):
    cfg = make_cfg(tie_embeddings=tied, num_kv_heads=kv)
    model = Transformer(cfg)
    h, f, v, layers, hd = 64, 128, 256, 2, 16
    per_layer = h * 4 * hd * 2 + h * kv * hd * 2 + 3 * h * f + 2 * h
    expected = v * h + layers * per_layer + h + (0 if tied else v * h)
    assert count_parameters(cfg) == expected == num_parameters(model)
    assert parameter_bytes(model) == 4 * expected


def test_init_is_deterministic_and_keyed_by_parameter_name():
    cfg = make_cfg(tie_embeddings=False)
    a, b, c = Transformer(cfg, seed=9), Transformer(cfg, seed=9), Transformer(cfg, seed=10)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    dims = ModelShape.from_config(cfg)
    # The init is a pure function of (seed, name): what the pipeline and tp layouts rely on.
    torch.testing.assert_close(
        a.get_parameter("layers.1.attn.wq.weight"), full_normal((64, 64), dims.init_std, 9, "layers.1.attn.wq.weight"),
        atol=0, rtol=0,
    )
    torch.testing.assert_close(
        a.get_parameter("layers.0.mlp.w_down.weight"),
        full_normal((64, 128), dims.residual_init_std, 9, "layers.0.mlp.w_down.weight"), atol=0, rtol=0,
    )
    assert set(a.full_state_dict()) == {n for n, _ in a.named_parameters()}


def test_config_defaults_resolve():
    cfg = SimpleNamespace(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=None, ffn_hidden_size=None,
                          vocab_size=256, seq_len=8, tie_embeddings=True)
    dims = ModelShape.from_config(cfg)
    assert (dims.num_kv_heads, dims.ffn_hidden_size, dims.rope_theta, dims.norm_eps, dims.init_std) == (
        4, 192, 10000.0, 1e-5, 0.02)


def test_causal_attention_gqa_equals_expanded_heads():
    from rayspeed.model.attention import causal_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 16, generator=gen)
    k, v = torch.randn(2, 2, 8, 16, generator=gen), torch.randn(2, 2, 8, 16, generator=gen)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(causal_attention(q, k, v), expected)
    torch.testing.assert_close(causal_attention(q, k, v),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
