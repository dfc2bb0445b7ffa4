"""model.attention_kernel: flex (FlexAttention) against the SDPA and math paths, fp32, rtol = atol = 1e-5, on its
CPU forward (torch 2.13 has its backward on CUDA only): causal, sliding windows, packed documents, both, soft-capped
scores with a window, grouped kv heads and a custom scale; then whole models (a Mistral with a window over packed
documents, a Gemma 2 with soft-capping and local layers) give the same logits through either kernel; a CPU job that
asks for flex, or an unknown kernel, is exit 2 naming the key."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

TOL = dict(rtol=1e-5, atol=1e-5)
S = 24


def _qkv(heads=4, kv=2, d=16, b=2):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(b, heads, S, d, generator=g), torch.randn(b, kv, S, d, generator=g),
            torch.randn(b, kv, S, d, generator=g))


def _documents(b=2):
    seg = torch.zeros(b, S, dtype=torch.long)
    seg[0, 9:] = 1
    seg[1, 5:], seg[1, 17:] = 1, 2
    return seg


@pytest.mark.parametrize("window,documents,cap,scale", [
    (None, False, None, None), (5, False, None, None), (None, True, None, None), (6, True, None, 0.3),
    (None, False, 2.0, None), (7, True, 3.0, 0.2)])
def test_flex_equals_sdpa_and_the_math_path(window, documents, cap, scale):
    from rayspeed.model.attention import MaskRows, masked_attention
    from rayspeed.model.flex import flex_attention

    q, k, v = _qkv()
    rows = MaskRows.of(S, _documents() if documents else None, window)
    with torch.no_grad():
        want = masked_attention(q, k, v, rows, scale, cap)
        got = flex_attention(q, k, v, rows, scale, cap)
    torch.testing.assert_close(got, want, **TOL)


def _model(arch, kernel, **keys):
    from rayspeed.config.shape import ModelShape
    from rayspeed.model.transformer import Transformer

    shape = ModelShape.from_config(SimpleNamespace(
        architecture=arch, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        vocab_size=64, seq_len=S, tie_embeddings=True, attention_kernel=kernel, **keys))
    return Transformer(shape, seed=5).eval()


@pytest.mark.parametrize("arch,keys,documents", [
    ("MistralForCausalLM", dict(sliding_window=6), True),
    ("Gemma2ForCausalLM", dict(sliding_window=5, attn_logit_softcapping=2.0, query_pre_attn_scalar=24.0,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                               hidden_act="gelu_pytorch_tanh"), False)])
def test_a_model_gives_the_same_logits_through_either_kernel(arch, keys, documents, monkeypatch):
    from rayspeed.model import flex
    from rayspeed.model.parts import self_attention

    ids = torch.randint(0, 64, (2, S), generator=torch.Generator().manual_seed(1))
    seg = _documents() if documents else None
    calls = []
    monkeypatch.setattr(self_attention, "flex_attention", lambda *a: calls.append(1) or flex.flex_attention(*a))
    with torch.no_grad():
        want = _model(arch, "sdpa", **keys)(ids, segment_ids=seg)
        assert not calls
        got = _model(arch, "flex", **keys)(ids, segment_ids=seg)
    assert len(calls) == 3  # every layer took the flex path
    torch.testing.assert_close(got, want, **TOL)


def test_flex_is_for_gpu_jobs_and_an_unknown_kernel_is_named():
    from rayspeed.config.load import parse
    from rayspeed.errors import ConfigError

    base = {"name": "t", "cluster": {"num_workers": 1}}
    for kernel, said in (("flex", "model.attention_kernel: flex trains on CUDA only"),
                         ("fused", "model.attention_kernel: must be auto, sdpa or flex")):
        with pytest.raises(ConfigError) as refused:
            parse({**base, "model": {"attention_kernel": kernel}})
        assert said in str(refused.value), str(refused.value)
    assert parse({**base, "model": {"attention_kernel": "sdpa"}}).model.attention_kernel == "sdpa"
