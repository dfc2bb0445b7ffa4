"""Sliding-window attention against transformers: Mistral (the window on every layer) and Qwen2 (the window on
the layers config.json's layer_types name, with q/k/v biases and linear RoPE scaling), windows of 5 and 6 under a
16-token sequence, fp32, rtol = atol = 1e-5: logits, loss and every gradient at tp1, a packed row of documents
longer than the window (each equal to transformers alone, at tp1, at tp2 with sequence parallelism and through two
pipeline stages), each rank's logits, loss and gradient shards at tp2 with sequence parallelism, pp2's logits and
loss, and the export read back by transformers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _dist import run_distributed
from _hf_models import MISTRAL_SWA, QWEN2_SWA, save, shape_of
from _hf_parity import (
    TOL,
    assert_pp2_gradients,
    assert_rank_matches,
    assert_tp1_matches,
    build,
    init_deepspeed_gloo,
    reference,
    tokens,
    tp2_and_pp2,
)

SEQ, BATCH = 16, 2
SPECS = {"mistral": MISTRAL_SWA, "qwen2": QWEN2_SWA}


def _tokens(vocab, seed=5):
    return tokens(vocab, BATCH, SEQ, seed)


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    out = {}
    for name, spec in SPECS.items():
        d = tmp_path_factory.mktemp(name) / "m"
        save(d, spec, seed=11)
        out[name] = reference(str(d), _tokens(spec["vocab"]))
        assert out[name]["model"].config.sliding_window == spec["sliding_window"]
    return out


def test_the_shapes_say_which_layers_slide(refs):
    assert [shape_of(refs["mistral"]["dir"], SEQ).window_of(i) for i in range(2)] == [5, 5]
    assert [shape_of(refs["qwen2"]["dir"], SEQ).window_of(i) for i in range(3)] == [None, 6, 6]


@pytest.mark.parametrize("family", sorted(SPECS))
def test_tp1_logits_loss_and_gradients_match_transformers(refs, family):
    ref = refs[family]
    shape = shape_of(ref["dir"], SEQ)
    ids = _tokens(shape.vocab_size)
    with torch.no_grad():
        # The window matters at this length: without it the logits are another model's.
        full = build(dataclasses.replace(shape, sliding_window=None), ref["dir"])(ids[:, :-1])
        assert (full - ref["logits"]).abs().max() > 1e-3
    assert_tp1_matches(build(shape, ref["dir"]), ref, shape, ids)


@pytest.mark.parametrize("family", sorted(SPECS))
def test_a_packed_row_of_documents_longer_than_the_window_equals_each_alone(refs, family):
    ref = refs[family]
    shape = shape_of(ref["dir"], SEQ)
    model = build(shape, ref["dir"])
    ids = _tokens(shape.vocab_size)[:1, :SEQ]
    lens = (9, 7)
    segments = torch.cat([torch.full((n,), k) for k, n in enumerate(lens)])[None]
    with torch.no_grad():
        packed = model(ids, segment_ids=segments)
        start = 0
        for n in lens:
            alone = ref["model"](ids[:, start:start + n]).logits.float()
            torch.testing.assert_close(packed[:, start:start + n], alone, **TOL)
            start += n


def _ranks(rank, world_size, dirs):
    init_deepspeed_gloo()
    out = {}
    for family, model_dir in sorted(dirs.items()):
        shape = shape_of(model_dir, SEQ)
        out[family] = tp2_and_pp2(shape, model_dir, _tokens(shape.vocab_size))
    return out


def test_tp2_sequence_parallel_and_pp2_match_transformers(refs):
    results = run_distributed(_ranks, 2, {f: r["dir"] for f, r in refs.items()}, timeout_s=180)
    for rank, by_family in enumerate(results):
        for family, result in by_family.items():
            assert_rank_matches(result, rank, refs[family], shape_of(refs[family]["dir"], SEQ), family)
    for family, ref in refs.items():
        assert_pp2_gradients([r[family][3][2] for r in results], ref, shape_of(ref["dir"], SEQ), family)


LENS = (9, 8)  # two documents, each longer than either window, packed in 17 tokens: 16 inputs, 16 labels


def _packed(vocab):
    row = _tokens(vocab)[0, :sum(LENS)]
    seg = torch.cat([torch.full((n,), k) for k, n in enumerate(LENS)])
    y = row[1:].clone()
    y[seg[1:] != seg[:-1]] = -100  # no label across the documents' boundary
    return row[None, :-1], y[None], seg[None, :-1]


def _packed_ranks(rank, world_size, dirs):
    import deepspeed

    from rayspeed.engine.pipeline_module import build_pipeline_module
    from rayspeed.model.hf_weights import load_hf_weights
    from rayspeed.parallel.groups import ParallelGroups
    from rayspeed.parallel.layers import deferred_init

    init_deepspeed_gloo()
    out = {}
    for family, model_dir in sorted(dirs.items()):
        shape = shape_of(model_dir, SEQ)
        x, y, seg = _packed(shape.vocab_size)
        model = build(shape, model_dir, ParallelGroups(dp=1, tp=2, pp=1).tp, sp=True)
        with torch.no_grad():
            tp2 = (model(x, segment_ids=seg), model(x, y, seg))
        with deferred_init():
            module = build_pipeline_module(shape, ParallelGroups(dp=1, tp=1, pp=2), num_stages=2,
                                           partition_method="type:Block")
        load_hf_weights(module, model_dir, shape)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.0),
                                               config=config)
        out[family] = (*tp2, engine.eval_batch(iter([((x, seg), y)])).detach().float().reshape(()))
    return out


def test_a_packed_row_longer_than_the_window_is_each_document_alone_under_tp2_sp_and_pp2(refs):
    import torch.nn.functional as F

    results = run_distributed(_packed_ranks, 2, {f: r["dir"] for f, r in refs.items()}, timeout_s=180)
    for family, ref in refs.items():
        x, y, _ = _packed(shape_of(ref["dir"], SEQ).vocab_size)
        with torch.no_grad():  # each document alone through transformers: its logits and its summed loss
            alone, total, start = [], 0.0, 0
            for n in LENS:
                doc = torch.cat([x[0], y[0, -1:]])[start:start + n]
                logits = ref["model"](doc[None, :-1]).logits.float()
                alone.append(logits[0])
                total += float(F.cross_entropy(logits[0], doc[1:], reduction="sum"))
                start += n
        want_loss = total / sum(n - 1 for n in LENS)
        for rank, by_family in enumerate(results):
            logits, loss, pp_loss = by_family[family]
            where = f"{family} rank {rank}"
            torch.testing.assert_close(logits[0, :LENS[0] - 1], alone[0], **TOL, msg=lambda m: f"{where}: {m}")
            torch.testing.assert_close(logits[0, LENS[0]:], alone[1], **TOL, msg=lambda m: f"{where}: {m}")
            assert float(loss) == pytest.approx(want_loss, rel=1e-5, abs=1e-5), where
            assert float(pp_loss) == pytest.approx(want_loss, rel=1e-5, abs=1e-5), where


@pytest.mark.parametrize("family", sorted(SPECS))
def test_the_export_keeps_the_window(tmp_path, refs, family):
    import json

    from transformers import AutoModelForCausalLM

    from rayspeed.model.hf_export import write_hf_dir

    ref = refs[family]
    shape = shape_of(ref["dir"], SEQ)
    model = build(shape, ref["dir"]).eval()
    write_hf_dir(model.full_state_dict(), shape, str(tmp_path / "hf"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["sliding_window"] == SPECS[family]["sliding_window"]
    if family == "qwen2":
        assert (cfg["use_sliding_window"], cfg["max_window_layers"], cfg["layer_types"]) == (
            True, 1, QWEN2_SWA["layer_types"])
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ids = _tokens(shape.vocab_size)[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits.float(), model(ids), **TOL)
