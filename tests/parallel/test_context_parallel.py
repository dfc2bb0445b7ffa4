"""Context parallelism against the unsplit model (4 gloo ranks, fp32, rtol = atol = 1e-5): the loss summed over the
cp group and every gradient summed over it equal the unsplit model's on the same weights and tokens, for the ulysses
and ring schemes at cp2 and cp4, with GQA (also fewer kv heads than cp), packed documents, a sliding window and
soft-capped scores, a mixture of experts (its balance loss pooled over the parts), and at tp2 x cp2 with and without
sequence parallelism (each tp rank's shards). The unsplit model is itself parity-tested against transformers
(tests/model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from _dist import run_distributed

TOL = dict(rel=1e-5, abs=1e-5)
SEQ = 32
CASES = {
    "causal": {},
    "documents+window": dict(architecture="MistralForCausalLM", sliding_window=6, documents=True),
    "softcap": dict(attn_logit_softcapping=5.0, documents=True),
    "gqa-2-kv-heads": dict(num_kv_heads=2),  # fewer kv heads than cp4: ulysses repeats them
    # a mixture of experts: the balance loss pools every part's routing (its gradient reaching every part's router)
    "moe": dict(architecture="MixtralForCausalLM", num_experts=4, experts_per_token=2, router_aux_loss_coef=0.5,
                documents=True),
}


def _cfg(case):
    extra = {k: v for k, v in CASES[case].items() if k != "documents"}
    return SimpleNamespace(**{**dict(hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4, ffn_hidden_size=96,
                                     vocab_size=128, seq_len=SEQ, tie_embeddings=False), **extra})


def _batch(case):
    import torch

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (2, SEQ), generator=g)
    labels = torch.randint(0, 128, (2, SEQ), generator=g)
    labels[0, :5] = -100  # a prompt: the divisor counts the labels of every part
    seg = None
    if CASES[case].get("documents"):
        seg = torch.tensor([[0] * 11 + [1] * 13 + [2] * 8, [0] * 3 + [1] * 20 + [2] * 9])
    return ids, labels, seg


def _one(case, scheme, tp, cp, sp=False):
    import torch.distributed as dist

    from rayspeed.model import Transformer
    from rayspeed.parallel.context_parallel import shard

    cfg = _cfg(case)
    ids, labels, seg = _batch(case)
    ref = Transformer(cfg, tp=tp, seed=7)
    want = ref(ids, labels, seg)
    want.backward()
    model = Transformer(cfg, tp=tp, sequence_parallel=sp, seed=7, cp=cp)
    loss = model(shard(ids, cp), shard(labels, cp), None if seg is None else shard(seg, cp))
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp.group)
    out = {"loss": (float(total), float(want.detach())), "grads": {}}
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=cp.group)
        out["grads"][name] = float((g - q.grad).abs().max()), float(q.grad.abs().max())
    return out


def _world(rank, world_size):
    import torch
    import torch.distributed as dist

    from rayspeed.parallel.context_parallel import ContextParallel
    from rayspeed.parallel.groups import TensorParallel

    torch.manual_seed(0)
    groups = {r: dist.new_group(list(r)) for r in ((0, 1, 2, 3), (0, 1), (2, 3), (0, 2), (1, 3))}
    mine = {k: g for k, g in groups.items() if rank in k}
    pairs = [k for k in mine if len(k) == 2]
    tp2 = TensorParallel.from_group(mine[pairs[0]])  # {0, 1} or {2, 3}: consecutive ranks, tp innermost
    results = {}
    for scheme in ("ulysses", "ring"):
        cp4 = ContextParallel.from_ranks(mine[(0, 1, 2, 3)], [0, 1, 2, 3], scheme)
        cp2 = ContextParallel.from_ranks(mine[pairs[0]], list(pairs[0]), scheme)
        cp2_tp2 = ContextParallel.from_ranks(mine[pairs[1]], list(pairs[1]), scheme)
        for case in CASES:
            results[(scheme, case, "cp4")] = _one(case, scheme, None, cp4)
            results[(scheme, case, "cp2")] = _one(case, scheme, None, cp2)
        results[(scheme, "documents+window", "tp2xcp2")] = _one("documents+window", scheme, tp2, cp2_tp2)
        results[(scheme, "documents+window", "tp2+sp x cp2")] = _one("documents+window", scheme, tp2, cp2_tp2, sp=True)
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(_world, 4, timeout_s=300)


def test_the_loss_and_every_gradient_summed_over_cp_equal_the_unsplit_models(results):
    assert len(results[0]) == 2 * (2 * len(CASES) + 2)
    for rank in results:
        for key, res in rank.items():
            got, want = res["loss"]
            assert got == pytest.approx(want, **TOL), key
            for name, (diff, scale) in res["grads"].items():
                assert diff <= TOL["abs"] + TOL["rel"] * scale, (key, name, diff, scale)
            assert any(scale > 0 for _, scale in res["grads"].values())


def test_the_parts_are_balanced_zigzag_chunks_that_cover_the_sequence():
    import torch

    from rayspeed.parallel.context_parallel import chunk_index

    parts = [chunk_index(16, 4, r).tolist() for r in range(4)]
    assert parts[0] == [0, 1, 14, 15] and parts[3] == [6, 7, 8, 9]
    assert sorted(sum(parts, [])) == list(range(16))
    # Causal work per rank (keys visible to its queries) is the same on every rank.
    work = [sum(i + 1 for i in p) for p in parts]
    assert len(set(work)) == 1, work
    with pytest.raises(ValueError, match="2 x cp = 8"):
        chunk_index(12, 4, 0)
    assert torch.equal(chunk_index(8, 1, 0), torch.arange(8))
