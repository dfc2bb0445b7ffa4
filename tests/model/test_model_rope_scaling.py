"""Long-context RoPE against transformers: yarn (a Qwen3 checkpoint) and longrope (a Llama checkpoint), past their
original context of 8 positions and, for longrope, within it (its short factors), fp32, rtol = atol = 1e-5:
logits, loss and every gradient; each scaling changes the logits (so the parity sees it); tp2 with sequence
parallelism and pp2 (DeepSpeed's pipeline: the last stage's logits, every stage's loss); the export keeps the
scaling and loads back to the same logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _dist import run_distributed
from _hf_models import LLAMA_LONGROPE, QWEN3_YARN, save, shape_of
from _hf_parity import assert_pp2_gradients, build, init_deepspeed_gloo, pipeline_logits_and_loss, reference, tokens

TOL = dict(rtol=1e-5, atol=1e-5)
SPECS = {"yarn": QWEN3_YARN, "longrope": LLAMA_LONGROPE}
CASES = [("yarn", 16), ("longrope", 16), ("longrope", 6)]  # 6 <= 8: longrope's short factors


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    out = {}
    for kind, spec in SPECS.items():
        d = tmp_path_factory.mktemp(kind) / "m"
        save(d, spec, seed=9)
        out[kind] = str(d)
    return out


@pytest.mark.parametrize("kind,seq", CASES)
def test_logits_loss_and_gradients_match_transformers(dirs, kind, seq):
    ids = tokens(256, 2, seq)
    ref = reference(dirs[kind], ids)
    assert ref["model"].config.rope_parameters["rope_type"] == kind
    shape = shape_of(dirs[kind], seq)
    assert shape.rope_type == kind and shape.rope_original_max_positions == 8
    model = build(shape, dirs[kind])
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:, :-1]), ref["logits"], **TOL)
        plain = build(dataclasses.replace(shape, rope_type="default"), dirs[kind])(ids[:, :-1])
        assert (plain - ref["logits"]).abs().max() > 1e-3  # the scaling matters here
    loss = model(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(loss.detach(), ref["loss"], **TOL)
    loss.backward()
    names = shape.family.tensor_names
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref["grads"][names.hf_name(name)], **TOL, msg=lambda m: f"{name}: {m}")


def _ranks(rank, world_size, model_dirs):
    import torch.distributed as dist

    from rayspeed.parallel.groups import ParallelGroups

    init_deepspeed_gloo()
    groups = ParallelGroups(dp=1, tp=2, pp=1)
    out = {}
    for kind, model_dir in sorted(model_dirs.items()):
        shape = shape_of(model_dir, 16)
        ids = tokens(256, 2, 16)
        with torch.no_grad():
            logits = build(shape, model_dir, groups.tp, sp=True)(ids[:, :-1])
        dist.barrier()
        out[kind] = (logits, pipeline_logits_and_loss(shape, model_dir, ParallelGroups(dp=1, tp=1, pp=2), ids))
    return out


def test_tp2_sequence_parallel_and_pp2_match_transformers(dirs):
    refs = {kind: reference(d, tokens(256, 2, 16)) for kind, d in dirs.items()}
    results = run_distributed(_ranks, 2, dirs, timeout_s=120)
    for kind, d in dirs.items():
        assert_pp2_gradients([got[kind][1][2] for got in results], refs[kind], shape_of(d, 16), kind)
    for rank, got in enumerate(results):
        for kind, (logits, (pp_logits, pp_loss, _)) in got.items():
            torch.testing.assert_close(logits, refs[kind]["logits"], **TOL, msg=lambda m: f"{kind} rank {rank}: {m}")
            torch.testing.assert_close(pp_loss, refs[kind]["loss"], **TOL, msg=lambda m: f"{kind} pp2 loss: {m}")
            if rank == 1:
                torch.testing.assert_close(pp_logits, refs[kind]["logits"], **TOL, msg=lambda m: f"{kind} pp2: {m}")


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_the_export_keeps_the_scaling(tmp_path, dirs, kind):
    import json

    from transformers import AutoModelForCausalLM

    from rayspeed.model.hf_export import write_hf_dir

    shape = shape_of(dirs[kind], 16)
    model = build(shape, dirs[kind]).eval()
    write_hf_dir(model.full_state_dict(), shape, str(tmp_path / "hf"))
    rope = json.loads((tmp_path / "hf" / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == kind and rope["original_max_position_embeddings"] == 8
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ids = tokens(256, 2, 16)[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits.float(), model(ids), **TOL)


def test_longrope_factors_that_do_not_fit_the_head_are_named(tmp_path):
    import json

    from rayspeed.config.load import parse
    from rayspeed.errors import ConfigError

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 1024,
           "original_max_position_embeddings": 256,  # Phi-3's top-level form
           "rope_scaling": {"rope_type": "longrope", "long_factor": [1.0, 2.0], "short_factor": [1.0] * 8}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        parse({"model": {"seq_len": 64}}, [f"model.pretrained={tmp_path}", "model.init=random"])
    assert e.value.problems == ["model.rope_scaling: longrope long_factor must give 8 factors (head_dim / 2), got 2"]
    cfg["rope_scaling"]["long_factor"] = [1.0] * 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = parse({"model": {"seq_len": 64}}, [f"model.pretrained={tmp_path}", "model.init=random"]).model
    assert (m.rope_scaling["original_max_position_embeddings"], m.rope_scaling["factor"]) == (256, 4.0)
