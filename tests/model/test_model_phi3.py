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
from _hf_parity import build, init_deepspeed_gloo, pipeline_logits_and_loss, reference, shard, tokens

SEQ, BATCH = 16, 2
TOL = dict(rtol=1e-5, atol=1e-5)
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


def _expected_grad(ref, shape, name, rank=0, world=1):
    """transformers' gradient of rayspeed parameter `name`: its rows of a fused tensor, then this tp rank's shard."""
    from rayspeed.config.hf_checkpoint import checkpoint_layout, param_shapes

    hf, offset = checkpoint_layout(shape)[name]
    rows = param_shapes(shape)[name][0]
    whole = ref["grads"][hf][offset:offset + rows]
    return shard(whole, shape.family.tensor_names.partition_dim(name), rank, world)


def test_the_shapes_read_the_window_longrope_and_the_partial_rotary(refs):
    phi3, mini = shape_of(refs["phi3"]["dir"], SEQ), shape_of(refs["phi4_mini"]["dir"], SEQ)
    assert (phi3.sliding_window, phi3.rope_type, phi3.rope_original_max_positions, phi3.rotary_dim) == (
        5, "longrope", 8, 8)
    assert (mini.sliding_window, mini.partial_rotary_factor, mini.head_dim, mini.rotary_dim) == (None, 0.5, 16, 8)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_tp1_logits_loss_and_gradients_match_transformers(refs, name):
    ref = refs[name]
    shape = shape_of(ref["dir"], SEQ)
    model = build(shape, ref["dir"])
    ids = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:, :-1]), ref["logits"], **TOL)
    loss = model(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(loss.detach(), ref["loss"], **TOL)
    loss.backward()
    for pname, p in model.named_parameters():
        torch.testing.assert_close(p.grad, _expected_grad(ref, shape, pname), **TOL, msg=lambda m: f"{pname}: {m}")


def _ranks(rank, world_size, dirs):
    import torch.distributed as dist

    from rayspeed.parallel.groups import ParallelGroups

    init_deepspeed_gloo()
    out = {}
    for name, model_dir in sorted(dirs.items()):
        shape = shape_of(model_dir, SEQ)
        model = build(shape, model_dir, ParallelGroups(dp=1, tp=2, pp=1).tp, sp=True)
        ids = _tokens()
        with torch.no_grad():
            logits = model(ids[:, :-1])
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        dist.barrier()
        out[name] = (logits, loss.detach(), grads,
                     pipeline_logits_and_loss(shape, model_dir, ParallelGroups(dp=1, tp=1, pp=2), ids))
    return out


def test_tp2_sequence_parallel_and_pp2_match_transformers(refs):
    results = run_distributed(_ranks, 2, {n: r["dir"] for n, r in refs.items()}, timeout_s=180)
    for rank, by_name in enumerate(results):
        for name, (logits, loss, grads, (pp_logits, pp_loss)) in by_name.items():
            ref, where = refs[name], f"{name} rank {rank}"
            shape = shape_of(ref["dir"], SEQ)
            torch.testing.assert_close(pp_loss, ref["loss"], **TOL, msg=lambda m: f"{where} pp2 loss: {m}")
            if rank == 1:
                torch.testing.assert_close(pp_logits, ref["logits"], **TOL, msg=lambda m: f"{where} pp2 logits: {m}")
            torch.testing.assert_close(logits, ref["logits"], **TOL, msg=lambda m: f"{where} logits: {m}")
            torch.testing.assert_close(loss, ref["loss"], **TOL, msg=lambda m: f"{where} loss: {m}")
            for pname, g in grads.items():
                torch.testing.assert_close(g, _expected_grad(ref, shape, pname, rank, 2), **TOL,
                                           msg=lambda m: f"{where} {pname}: {m}")


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
