"""A mask that would grow with s squared is built a tile of query rows at a time (model/attention.py masked_attention):
the output and the gradients of q, k and v equal the whole-mask attention's (fp32, 1e-5) for documents, a sliding
window, GQA, soft-capped scores and positions out of order (a context-parallel layout's), no mask built is larger
than one tile, and a model with packed documents trains the same with tiles as without."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rayspeed.model import attention
from rayspeed.model.attention import MaskRows, causal_attention, masked_attention

TOL = dict(rtol=1e-5, atol=1e-5)
S = 48


def _qkv(heads=4, kv=2, d=8, b=2):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, n, S, d, generator=g, requires_grad=True) for n in (heads, kv, kv)]


def _segments(b=2):
    return torch.tensor([[0] * 10 + [1] * 30 + [2] * 8, [0] * 25 + [1] * 23])[:b]


def _grads(fn, q, k, v):
    out = fn(q, k, v)
    out.square().sum().backward()
    got = [out.detach()] + [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return got


CASES = {
    "documents": dict(seg=True, window=None, cap=None, ordered=True),
    "documents+window": dict(seg=True, window=7, cap=None, ordered=True),
    "window": dict(seg=False, window=5, cap=None, ordered=True),
    "softcap": dict(seg=True, window=None, cap=5.0, ordered=True),
    "out of order": dict(seg=True, window=9, cap=None, ordered=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiles_equal_the_whole_mask(monkeypatch, case):
    c = CASES[case]
    seg = _segments() if c["seg"] else None
    if c["ordered"]:
        rows = MaskRows.of(S, seg, c["window"])
    else:  # a zigzag order of the positions, as Ulysses sees the whole sequence
        pos = torch.cat([torch.arange(0, 6), torch.arange(42, 48), torch.arange(6, 42)])
        s = None if seg is None else seg[:, pos]
        rows = MaskRows(pos, pos, s, s, c["window"])
    q, k, v = _qkv()
    want = _grads(lambda q, k, v: causal_attention(q, k, v, rows.rows(0, S), 0.3, c["cap"]), q, k, v)
    built = []
    original = MaskRows.rows

    def counting(self, *args):
        m = original(self, *args)
        built.append(m.shape[-2] * m.shape[-1])
        return m

    monkeypatch.setattr(MaskRows, "rows", counting)
    monkeypatch.setattr(attention, "MASK_TILE_BYTES", 2 * 10 * S)  # 10 query rows a tile with documents (batch 2)
    got = _grads(lambda q, k, v: masked_attention(q, k, v, rows, 0.3, c["cap"]), q, k, v)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    tile = 2 * 10 * S // (rows.batch * S)
    # Forward and the recomputation in backward, one tile at a time; no mask larger than a tile.
    assert len(built) == 2 * -(-S // tile) and max(built) <= tile * S


def test_a_model_with_packed_documents_trains_the_same_with_tiles(monkeypatch):
    from rayspeed.model import Transformer

    cfg = SimpleNamespace(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                          vocab_size=64, seq_len=S, tie_embeddings=False, architecture="MistralForCausalLM",
                          sliding_window=12)
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 64, (2, S), generator=g), torch.randint(0, 64, (2, S), generator=g)

    def run():
        model = Transformer(cfg, seed=3)
        loss = model(ids, labels, _segments())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want_loss, want = run()
    monkeypatch.setattr(attention, "MASK_TILE_BYTES", 2 * 16 * S)
    got_loss, got = run()
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL)


def test_the_planner_tiles_where_the_model_does():
    from rayspeed.planner import memory

    assert memory.MASK_TILE_BYTES == attention.MASK_TILE_BYTES
