"""Qwen3 parity with transformers (Qwen3ForCausalLM made locally: per-head q/k norms, head_dim 16 where hidden /
heads is 8, tied embeddings), fp32, rtol = atol = 1e-5: logits, loss and every parameter's gradient at tp1; at tp2
with sequence parallelism each rank's logits and loss, and every parameter's gradient (each rank's shard; the q/k
norms, which each rank applies to its own heads only, have their gradient summed over the tp group); at pp2 (DeepSpeed's
pipeline, Qwen3's blocks split by type) the last stage's logits and every stage's loss; and the export loads back
as a Qwen3ForCausalLM with rayspeed's logits."""

from __future__ import annotations

import pytest
import torch

from _dist import run_distributed
from _hf_models import QWEN3, first_batch_loss, save, shape_of
from _hf_parity import assert_pp2_gradients, build, init_deepspeed_gloo, reference, shard, tokens, tp2_and_pp2

SEQ, BATCH = 16, 2
TOL = dict(rtol=1e-5, atol=1e-5)


def _tokens(vocab, seed=5):
    return tokens(vocab, BATCH, SEQ, seed)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3") / "m"
    save(d, QWEN3, seed=13)
    ref = reference(str(d), _tokens(QWEN3["vocab"]))
    model = ref["model"]
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.head_dim == 16
    return ref


def test_the_shape_is_qwen3s(qwen3):
    shape = shape_of(qwen3["dir"], SEQ)
    assert (shape.architecture, shape.head_dim, shape.q_dim, shape.tie_embeddings) == ("Qwen3ForCausalLM", 16, 64,
                                                                                        True)
    model = build(shape, qwen3["dir"])
    assert sum(p.numel() for p in model.parameters()) == shape.params  # the q/k norms are counted


def test_tp1_logits_loss_and_gradients_match_transformers(qwen3):
    shape = shape_of(qwen3["dir"], SEQ)
    model = build(shape, qwen3["dir"])
    tokens = _tokens(shape.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens[:, :-1]), qwen3["logits"], **TOL)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    torch.testing.assert_close(loss.detach(), qwen3["loss"], **TOL)
    loss.backward()
    names = shape.family.tensor_names
    for name, p in model.named_parameters():
        ref = qwen3["grads"][names.hf_name(name)]
        torch.testing.assert_close(p.grad, ref, **TOL, msg=lambda m: f"{name}: {m}")


def _ranks(rank, world_size, model_dir):
    init_deepspeed_gloo()
    shape = shape_of(model_dir, SEQ)
    return tp2_and_pp2(shape, model_dir, _tokens(shape.vocab_size))


def test_tp2_sequence_parallel_and_pp2_match_transformers(qwen3):
    shape = shape_of(qwen3["dir"], SEQ)
    names = shape.family.tensor_names
    results = run_distributed(_ranks, 2, qwen3["dir"], timeout_s=120)
    assert_pp2_gradients([r[3][2] for r in results], qwen3, shape)
    for rank, (logits, loss, grads, (pp_logits, pp_loss, _)) in enumerate(results):
        torch.testing.assert_close(pp_loss, qwen3["loss"], **TOL, msg=lambda m: f"pp2 rank {rank} loss: {m}")
        if rank == 1:  # the last stage holds the head
            torch.testing.assert_close(pp_logits, qwen3["logits"], **TOL, msg=lambda m: f"pp2 logits: {m}")
        torch.testing.assert_close(logits, qwen3["logits"], **TOL, msg=lambda m: f"rank {rank} logits: {m}")
        torch.testing.assert_close(loss, qwen3["loss"], **TOL, msg=lambda m: f"rank {rank} loss: {m}")
        # Every parameter's gradient: each rank's shard against the same shard of transformers' (the q/k norms,
        # one head wide, whole on both ranks).
        assert len([n for n in grads if "q_norm" in n or "k_norm" in n]) == 2 * shape.num_layers
        for name, g in grads.items():
            ref = shard(qwen3["grads"][names.hf_name(name)], names.partition_dim(name), rank, 2)
            torch.testing.assert_close(g, ref, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


def test_a_qwen3_written_as_hf_loads_in_transformers_with_the_same_logits(tmp_path):
    """Out again: a rayspeed Qwen3 with random q/k norms, written in Hugging Face format, is a Qwen3ForCausalLM
    with rayspeed's logits."""
    import json

    from transformers import AutoModelForCausalLM

    from rayspeed.config.load import parse
    from rayspeed.config.shape import ModelShape
    from rayspeed.model.hf_export import write_hf_dir
    from rayspeed.model.transformer import Transformer

    m = parse({"model": {"architecture": "Qwen3ForCausalLM", "hidden_size": 32, "num_layers": 2, "num_heads": 4,
                         "num_kv_heads": 2, "head_dim": 16, "ffn_hidden_size": 64, "seq_len": SEQ,
                         "tie_embeddings": False}}).model
    shape = ModelShape.from_config(m)
    model = Transformer(shape, seed=4).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms away from 1, so a q/k norm left out shows
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
        ids = _tokens(256)[:, :-1]
        expected = model(ids)
    write_hf_dir(model.full_state_dict(), shape, str(tmp_path / "hf"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["architectures"], cfg["model_type"], cfg["head_dim"]) == (["Qwen3ForCausalLM"], "qwen3", 16)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits.float(), expected, **TOL)


def test_a_qwen3_job_starts_from_the_checkpoint_and_registers_a_qwen3(tmp_path):
    """The worker path end to end (tests/_inprocess.py: the launcher's steps here, two gloo workers at tp2):
    model.pretrained names a Qwen3 checkpoint; the first logged loss is transformers' own on step 1's batch, and
    the registered version loads in transformers as a Qwen3ForCausalLM."""
    import mlflow
    from transformers import AutoModelForCausalLM

    from _cluster import ROOT, metric_history
    from _inprocess import run_inprocess

    model_dir = tmp_path / "tiny-qwen3"
    save(model_dir, {**QWEN3, "max_positions": 256}, seed=3, tokenizer=True)
    seq, batch, seed = 128, 8, 1234
    sets = [f"model.pretrained={model_dir}", "name=tiny-qwen3", "train.max_steps=2", "tracking.log_every_steps=1",
            "cluster.num_workers=2", "parallel.tp=2", "parallel.zero_stage=0", "tracking.charts_every_checkpoints=0",
            "tracking.loss_landscape=false", "resilience.checkpoint_every_steps=0"]
    summary = run_inprocess(tmp_path, str(ROOT / "configs" / "tiny-pretrained-cpu.yaml"), sets, workers=2)
    assert summary["status"] == "finished" and summary["layout"]["tp"] == 2, summary

    expected, _ = first_batch_loss(tmp_path, model_dir, seq, batch, seed)
    (step, first), *_ = metric_history(tmp_path, summary["mlflow_run_id"], "train/loss")
    assert step == 1 and first == pytest.approx(expected, rel=1e-5)

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    from rayspeed.compat import mlflow_process_store

    with mlflow_process_store(uri):
        local = mlflow.artifacts.download_artifacts(
            f"models:/rayspeed-tiny-qwen3/{summary['registered_model_version']}", dst_path=str(tmp_path / "dl"))
    registered = AutoModelForCausalLM.from_pretrained(f"{local}/model", dtype=torch.float32)
    assert type(registered).__name__ == "Qwen3ForCausalLM" and registered.config.head_dim == 16
