"""Phi-3 and Phi-4-mini against transformers (Phi3ForCausalLM made locally: q, k and v fused in qkv_proj, gate and
up in gate_up_proj; a window of 5 on every layer with longrope past 8 positions; partial rotary 0.5 with a tied
head), fp32, rtol = atol = 1e-5: logits, loss and every gradient at tp1 (each part of a fused tensor against its
rows of transformers' gradient); at tp2 with sequence parallelism each rank's logits, loss and gradient shards
(each rank read only its rows of each part); pp2's logits and loss; and the export fuses them again and loads
back with the same logits."""

from __future__ import annotations

import pytest
import torch

from _dist import run_distributed
from _hf_models import PHI3, PHI4_MINI, save, shape_of
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
SPECS = {"phi3": PHI3, "phi4_mini": PHI4_MINI}


def _tokens(seed=5):
    return tokens(256, BATCH, SEQ, seed)


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    out = {}
    for name, spec in SPECS.items():
        d = tmp_path_factory.mktemp(name) / "m"
        save(d, spec, seed=13)
        out[name] = reference(str(d), _tokens())
        assert "model.layers.0.self_attn.qkv_proj.weight" in out[name]["grads"]
    return out


def test_the_shapes_read_the_window_longrope_and_the_partial_rotary(refs):
    phi3, mini = shape_of(refs["phi3"]["dir"], SEQ), shape_of(refs["phi4_mini"]["dir"], SEQ)
    assert (phi3.sliding_window, phi3.rope_type, phi3.rope_original_max_positions, phi3.rotary_dim) == (
        5, "longrope", 8, 8)
    assert (mini.sliding_window, mini.partial_rotary_factor, mini.head_dim, mini.rotary_dim) == (None, 0.5, 16, 8)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_tp1_logits_loss_and_gradients_match_transformers(refs, name):
    ref = refs[name]
    shape = shape_of(ref["dir"], SEQ)
    assert_tp1_matches(build(shape, ref["dir"]), ref, shape, _tokens())  # a fused part against its rows


def _ranks(rank, world_size, dirs):
    init_deepspeed_gloo()
    return {name: tp2_and_pp2(shape_of(model_dir, SEQ), model_dir, _tokens())
            for name, model_dir in sorted(dirs.items())}


def test_tp2_sequence_parallel_and_pp2_match_transformers(refs):
    results = run_distributed(_ranks, 2, {n: r["dir"] for n, r in refs.items()}, timeout_s=180)
    for rank, by_name in enumerate(results):
        for name, result in by_name.items():
            assert_rank_matches(result, rank, refs[name], shape_of(refs[name]["dir"], SEQ), name)
    for name, ref in refs.items():
        assert_pp2_gradients([r[name][3][2] for r in results], ref, shape_of(ref["dir"], SEQ), name)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_export_fuses_again_and_loads_with_the_same_logits(tmp_path, refs, name):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rayspeed.model.hf_export import write_hf_dir

    ref = refs[name]
    shape = shape_of(ref["dir"], SEQ)
    model = build(shape, ref["dir"]).eval()
    write_hf_dir(model.full_state_dict(), shape, str(tmp_path / "hf"))
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    original = load_file(f"{ref['dir']}/model.safetensors")
    assert set(written) == set(original)  # fused again: qkv_proj and gate_up_proj, no q_proj or gate_proj
    for key, value in original.items():
        torch.testing.assert_close(written[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ids = _tokens()[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits.float(), model(ids), **TOL)
