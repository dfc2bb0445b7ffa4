"""OLMo 2 parity with transformers (Olmo2ForCausalLM made locally: norms after attention and after the MLP, RMS norms
over the whole q and k projections, GQA, untied head), fp32, rtol = atol = 1e-5: logits, loss and every parameter's
gradient at tp1; at tp2 with sequence parallelism each rank's logits and loss and every parameter's gradient (each
rank's shard against the same shard of transformers' gradient: the q/k norms over a projection the ranks split
sum their squares over the tp group); at pp2 (DeepSpeed's pipeline) the last stage's logits and every stage's loss;
and the export loads back as an Olmo2ForCausalLM with rayspeed's logits."""

from __future__ import annotations

import pytest
import torch

from _dist import run_distributed
from _hf_models import OLMO2, save, shape_of
from _hf_parity import (
    assert_pp2_gradients,
    build,
    init_deepspeed_gloo,
    pipeline_logits_and_loss,
    reference,
    shard,
    tokens,
)

SEQ, BATCH = 16, 2
TOL = dict(rtol=1e-5, atol=1e-5)


def _tokens(vocab, seed=5):
    return tokens(vocab, BATCH, SEQ, seed)


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    d = tmp_path_factory.mktemp("olmo2") / "m"
    save(d, OLMO2, seed=17)
    ref = reference(str(d), _tokens(OLMO2["vocab"]))
    model = ref["model"]
    assert type(model).__name__ == "Olmo2ForCausalLM" and model.model.layers[0].self_attn.q_norm.weight.numel() == 32
    return ref


def test_the_shape_is_olmo2s(olmo2):
    shape = shape_of(olmo2["dir"], SEQ)
    assert (shape.architecture, shape.q_dim, shape.kv_dim, shape.tie_embeddings) == ("Olmo2ForCausalLM", 32, 16,
                                                                                     False)
    assert shape.norm_eps == pytest.approx(1e-6)  # the file's, not the family's default (1e-5)
    model = build(shape, olmo2["dir"])
    assert sum(p.numel() for p in model.parameters()) == shape.params  # the projection-wide q/k norms are counted


def test_tp1_logits_loss_and_gradients_match_transformers(olmo2):
    shape = shape_of(olmo2["dir"], SEQ)
    model = build(shape, olmo2["dir"])
    tokens = _tokens(shape.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens[:, :-1]), olmo2["logits"], **TOL)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    torch.testing.assert_close(loss.detach(), olmo2["loss"], **TOL)
    loss.backward()
    names = shape.family.tensor_names
    seen = set()
    for name, p in model.named_parameters():
        seen.add(names.hf_name(name))
        torch.testing.assert_close(p.grad, olmo2["grads"][names.hf_name(name)], **TOL, msg=lambda m: f"{name}: {m}")
    assert seen == set(olmo2["grads"])  # every tensor of the checkpoint is a parameter here, and none more


def _ranks(rank, world_size, model_dir):
    import torch.distributed as dist

    from rayspeed.parallel.groups import ParallelGroups

    init_deepspeed_gloo()
    shape = shape_of(model_dir, SEQ)
    groups = ParallelGroups(dp=1, tp=2, pp=1)
    model = build(shape, model_dir, groups.tp, sp=True)
    ids = _tokens(shape.vocab_size)
    with torch.no_grad():
        logits = model(ids[:, :-1])
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    whole = model.full_state_dict()  # the q/k norms gathered whole from the ranks' shards, like every tp shard
    norms = {n: whole[n] for n in whole if "q_norm" in n or "k_norm" in n}
    dist.barrier()
    pipeline = pipeline_logits_and_loss(shape, model_dir, ParallelGroups(dp=1, tp=1, pp=2), ids)
    return logits, loss.detach(), grads, norms, pipeline


def test_tp2_sequence_parallel_and_pp2_match_transformers(olmo2):
    shape = shape_of(olmo2["dir"], SEQ)
    names = shape.family.tensor_names
    from safetensors.torch import load_file

    stored = load_file(f"{olmo2['dir']}/model.safetensors")
    results = run_distributed(_ranks, 2, olmo2["dir"], timeout_s=120)
    assert_pp2_gradients([r[4][2] for r in results], olmo2, shape)
    for rank, (logits, loss, grads, norms, (pp_logits, pp_loss, _)) in enumerate(results):
        assert len(norms) == 2 * shape.num_layers
        for name, value in norms.items():
            torch.testing.assert_close(value, stored[names.hf_name(name)], **TOL, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(pp_loss, olmo2["loss"], **TOL, msg=lambda m: f"pp2 rank {rank} loss: {m}")
        if rank == 1:  # the last stage holds the head
            torch.testing.assert_close(pp_logits, olmo2["logits"], **TOL, msg=lambda m: f"pp2 logits: {m}")
        torch.testing.assert_close(logits, olmo2["logits"], **TOL, msg=lambda m: f"rank {rank} logits: {m}")
        torch.testing.assert_close(loss, olmo2["loss"], **TOL, msg=lambda m: f"rank {rank} loss: {m}")
        assert len(grads) == len(olmo2["grads"])
        for name, g in grads.items():
            ref = shard(olmo2["grads"][names.hf_name(name)], names.partition_dim(name), rank, 2)
            torch.testing.assert_close(g, ref, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


def test_an_olmo2_written_as_hf_loads_in_transformers_with_the_same_logits(tmp_path):
    """Out again: a rayspeed OLMo 2 with random norms, written in Hugging Face format, is an Olmo2ForCausalLM with
    rayspeed's logits."""
    import json

    from transformers import AutoModelForCausalLM

    from rayspeed.config.load import parse
    from rayspeed.config.shape import ModelShape
    from rayspeed.model.hf_export import write_hf_dir
    from rayspeed.model.transformer import Transformer

    m = parse({"model": {"architecture": "Olmo2ForCausalLM", "hidden_size": 32, "num_layers": 2, "num_heads": 4,
                         "num_kv_heads": 2, "ffn_hidden_size": 64, "seq_len": SEQ, "tie_embeddings": False}}).model
    shape = ModelShape.from_config(m)
    model = Transformer(shape, seed=4).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms away from 1, so a norm in the wrong place shows
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
        ids = _tokens(256)[:, :-1]
        expected = model(ids)
    write_hf_dir(model.full_state_dict(), shape, str(tmp_path / "hf"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["architectures"], cfg["model_type"]) == (["Olmo2ForCausalLM"], "olmo2")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits.float(), expected, **TOL)
