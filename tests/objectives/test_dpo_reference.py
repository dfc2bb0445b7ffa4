"""The DPO reference, three ways, on one model and one batch of pairs (fp32): log-probabilities precomputed with
the initial weights (rayspeed.objectives.reference.compute over a split's pairs, as the job's first pass does), a
resident frozen copy scoring each micro-batch, and, for an adapter job, the policy with its adapters turned off,
give the same loss (rtol = atol = 1e-5); the precomputed file round-trips and refuses a wrong shape; the rows of a
pair split are the prompt and each completion cut to seq_len + 1 tokens, the labels on the completion only."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

TOL = dict(rtol=1e-5, atol=1e-5)
SEQ = 12
MODEL = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64, vocab_size=64, seq_len=SEQ)


def _pairs():
    """Six pairs of random tokens: prompts of 3-6 tokens, completions of 2-8 (some rows cut at seq_len + 1), and one
    pair whose prompt alone fills the row (left out)."""
    from rayspeed.data.pairs import PairFile

    g = np.random.default_rng(3)
    lengths = [(3, 4, 2), (5, 8, 6), (4, 2, 9), (6, 3, 3), (3, 5, 7), (14, 2, 2)]
    tokens = g.integers(1, 64, size=sum(map(sum, lengths))).astype(np.int32)
    offsets = np.cumsum([0] + [sum(x) for x in lengths[:-1]])
    spans = np.asarray([(o, *x) for o, x in zip(offsets, lengths)], dtype=np.int64)
    return PairFile(tokens, spans, "test", "hash", pad_id=0)


def _objective(**kw):
    from rayspeed.config.objective_keys import DpoConfig
    from rayspeed.train.dpo_objective import DpoObjective

    cfg = SimpleNamespace(train=SimpleNamespace(dpo=DpoConfig(beta=0.3)), parallel=SimpleNamespace(grad_accum=1))
    groups = SimpleNamespace(dp=1, dp_group=None)
    return DpoObjective(cfg, groups, torch.device("cpu"), **kw)


def _model(seed):
    from rayspeed.config import parse
    from rayspeed.config.shape import ModelShape
    from rayspeed.model.transformer import Transformer

    return Transformer(ModelShape.from_config(parse({"model": MODEL, "data": {"tokenizer": "tok"}}).model), seed=seed)


class Engine:
    """What the objective calls: the model (forward) with its module (adapters_disabled)."""

    def __init__(self, module):
        self.module = module

    def __call__(self, *a, **kw):
        return self.module(*a, **kw)


def test_rows_cut_at_seq_len_plus_one_and_label_the_completion_only():
    pf = _pairs()
    split = pf.whole("train", SEQ)
    assert split.num_pairs == 5 and split.dropped == 1  # the 14-token prompt fills a 13-token row
    ids, labels = split.rows([1])
    p = pf.pair(1)
    chosen, rejected = p.prompt + p.chosen, p.prompt + p.rejected
    assert ids.shape == labels.shape == (2, SEQ)
    assert ids[0].tolist() == chosen[:SEQ] and ids[1].tolist() == rejected + [0] * (SEQ - len(rejected))
    assert labels[0].tolist() == [-100] * 4 + chosen[5:SEQ + 1]  # 13 tokens: the last is only a label
    assert labels[1].tolist() == [-100] * 4 + rejected[5:] + [-100] * (SEQ + 1 - len(rejected))


def test_precomputed_resident_and_adapter_off_references_give_one_loss(tmp_path):
    from rayspeed.adapters.attach import add_adapters
    from rayspeed.config.schema import AdapterConfig
    from rayspeed.data.pair_batches import pair_batch
    from rayspeed.objectives import reference

    split = _pairs().whole("train", SEQ)
    initial = _model(seed=1)
    scorer = _objective()
    logps = reference.compute(lambda pos: scorer.score(Engine(initial), split, pos, 2), split.num_pairs, 2, 0, 1, [],
                              torch.device("cpu"))
    key = reference.reference_key({"model": "m"}, split.content_hash)
    reference.save(str(tmp_path), key, logps)
    assert np.array_equal(reference.load(str(tmp_path), key, split.num_pairs), logps)
    assert reference.load(str(tmp_path), key, split.num_pairs + 1) is None

    policy = _model(seed=1)  # the seeded init: the initial weights again
    moved = torch.Generator().manual_seed(7)  # not the process's generator: what ran before in it changes nothing
    with torch.no_grad():  # a policy some steps past its reference: every reward nonzero
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=moved))
    positions = np.arange(split.num_pairs)
    precomputed = _objective().pair_loss(Engine(policy), pair_batch(split, positions, logps))[0]
    resident = _objective(resident=initial).pair_loss(Engine(policy), pair_batch(split, positions, None))[0]
    torch.testing.assert_close(resident, precomputed, **TOL)
    assert abs(float(precomputed) - np.log(2)) > 1e-3

    adapted = _model(seed=1)
    add_adapters(adapted, AdapterConfig(type="lora", rank=4, alpha=8.0), seed=2)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=moved)
    batch = pair_batch(split, positions, None)
    off = _objective(adapter=True).pair_loss(Engine(adapted), batch)[0]
    base = _objective(resident=initial).pair_loss(Engine(adapted), batch)[0]
    torch.testing.assert_close(off, base, **TOL)
    on = _objective(resident=adapted).pair_loss(Engine(adapted), batch)[0]
    assert float(on) == pytest.approx(np.log(2), abs=1e-6)  # the adapted model as its own reference
    assert abs(float(off) - np.log(2)) > 1e-3  # turning the adapters off changed the reference
