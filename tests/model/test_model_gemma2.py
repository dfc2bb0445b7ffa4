"""Gemma 2 parity with transformers (Gemma2ForCausalLM made locally: attention scores soft-capped at 2 and final
logits at 3, local layers with a window of 5 around a global one, four (1 + w) norms per block, GeGLU, the scaled
embedding, query_pre_attn_scalar, tied embeddings; transformers runs its eager attention, the only one that caps),
fp32, rtol = atol = 1e-5: logits, loss and every gradient at tp1 (each cap and the window change the logits, so
the parity sees them); at tp2 with sequence parallelism each rank's logits, loss and gradient shards (the final
cap on each rank's vocabulary slice); pp2's logits and loss; and the export loads back with the same logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _dist import run_distributed
from _hf_models import GEMMA2, save, shape_of
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


def _tokens(seed=5):
    return tokens(256, BATCH, SEQ, seed)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma2") / "m"
    save(d, GEMMA2, seed=21)
    ref = reference(str(d), _tokens())
    config = ref["model"].config
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (2.0, 3.0)
    assert config._attn_implementation == "eager"
    return ref


def test_tp1_logits_loss_and_gradients_match_transformers(gemma2):
    shape = shape_of(gemma2["dir"], SEQ)
    assert (shape.attn_logit_softcapping, shape.final_logit_softcapping, shape.sliding_window) == (2.0, 3.0, 5)
    model = build(shape, gemma2["dir"])
    assert sum(p.numel() for p in model.parameters()) == shape.params
    assert_tp1_matches(model, gemma2, shape, _tokens())


@pytest.mark.parametrize("change", [dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None),
                                    dict(sliding_window=None)])
def test_each_cap_and_the_window_change_the_logits(gemma2, change):
    shape = dataclasses.replace(shape_of(gemma2["dir"], SEQ), **change)
    with torch.no_grad():
        logits = build(shape, gemma2["dir"])(_tokens()[:, :-1])
    assert (logits - gemma2["logits"]).abs().max() > 1e-3


def _ranks(rank, world_size, model_dir):
    init_deepspeed_gloo()
    return tp2_and_pp2(shape_of(model_dir, SEQ), model_dir, _tokens())


def test_tp2_sequence_parallel_and_pp2_match_transformers(gemma2):
    shape = shape_of(gemma2["dir"], SEQ)
    results = run_distributed(_ranks, 2, gemma2["dir"], timeout_s=120)
    for rank, result in enumerate(results):
        assert_rank_matches(result, rank, gemma2, shape)
    assert_pp2_gradients([r[3][2] for r in results], gemma2, shape)


def test_the_export_loads_back_with_the_same_logits(tmp_path, gemma2):
    import json

    from transformers import AutoModelForCausalLM

    from rayspeed.model.hf_export import write_hf_dir

    shape = shape_of(gemma2["dir"], SEQ)
    model = build(shape, gemma2["dir"]).eval()
    write_hf_dir(model.full_state_dict(), shape, str(tmp_path / "hf"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["model_type"], cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"]) == ("gemma2", 2.0, 3.0)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ids = _tokens()[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits.float(), model(ids), **TOL)
