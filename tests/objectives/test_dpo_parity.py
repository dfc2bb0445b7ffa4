"""DPO parity with TRL 1.16 (fp32, rtol = atol = 1e-5): on a locally made Llama with its byte-level tokenizer and a
few standard-form preference records, TRL's DPOTrainer (its own tokenization, collation and loss; the reference the
checkpoint of other weights, so that every reward is nonzero; bf16 turned off, as TRL defaults it on: fp32) and
rayspeed's objective (rayspeed.objectives.dpo over rayspeed's Transformer on the same weights and the same collated
tokens) give the same loss, the same rewards/logps statistics and the same gradient of every weight, for the sigmoid,
ipo and robust losses."""

from __future__ import annotations

import pytest
import torch

from _hf_models import LLAMA_TIED, save

TOL = dict(rtol=1e-5, atol=1e-5)
RECORDS = [
    {"prompt": "What color is the sky? ", "chosen": "The sky is blue.", "rejected": "It is green, I think."},
    {"prompt": "Name a fruit: ", "chosen": "A banana.", "rejected": "Coal."},
    {"prompt": "2 + 2 = ", "chosen": "4", "rejected": "five, or so"},
]
CASES = {"sigmoid": dict(beta=0.1), "ipo": dict(beta=0.5), "robust": dict(beta=0.2, label_smoothing=0.1)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo")
    save(d / "llama", LLAMA_TIED, seed=4, tokenizer=True)
    save(d / "reference", LLAMA_TIED, seed=5, tokenizer=True)  # other weights: every reward is nonzero
    return d / "llama"


def _trl(model_dir, tmp_path, loss, settings):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.pad_token = tok.eos_token
    args = DPOConfig(output_dir=str(tmp_path / "trl"), loss_type=[loss], report_to=[], use_cpu=True, bf16=False,
                     per_device_train_batch_size=len(RECORDS), dataset_num_proc=None, **settings)
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir.parent / "reference"), dtype=torch.float32)
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=Dataset.from_list(RECORDS),
                         processing_class=tok)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(RECORDS))])
    trainer.model.train()
    value = trainer.compute_loss(trainer.model, batch)
    value.backward()
    stats = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith(("rewards/", "logps/"))}
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return value.detach(), stats, grads, batch


def _shape(model_dir):
    from types import SimpleNamespace

    from rayspeed.config.hf_config import model_keys_from_hf, read_pretrained_config
    from rayspeed.config.shape import ModelShape

    hf, path = read_pretrained_config(model_dir)
    keys, problems = model_keys_from_hf(hf, str(path), seq_len=64)
    assert not problems
    return ModelShape.from_config(SimpleNamespace(**keys, seq_len=64))


def _dpo_pass(policy, reference, ids, mask, loss, settings):
    """rayspeed's DPO loss and per-pair statistics of the batch, backward done on the policy."""
    from rayspeed.objectives.dpo import DpoSettings, completion_lengths, dpo_loss, sequence_logps

    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    logps = sequence_logps(-policy(ids[:, :-1], labels, reduction="none"), labels)
    with torch.no_grad():
        ref = sequence_logps(-reference(ids[:, :-1], labels, reduction="none"), labels)
    value, stats = dpo_loss(logps, ref, completion_lengths(labels), DpoSettings(loss=loss, **settings))
    value.backward()
    return value.detach(), {k: float(v.mean()) for k, v in stats.items()}


def _rayspeed(model_dir, batch, loss, settings):
    from rayspeed.model.hf_weights import load_hf_weights
    from rayspeed.model.transformer import Transformer

    shape = _shape(model_dir)
    policy, reference = Transformer(shape), Transformer(shape)
    load_hf_weights(policy, model_dir, shape)
    load_hf_weights(reference, model_dir.parent / "reference", shape)
    value, stats = _dpo_pass(policy, reference, batch["input_ids"], batch["completion_mask"], loss, settings)
    grads = {shape.family.tensor_names.hf_name(n): p.grad for n, p in policy.named_parameters()}
    return value, stats, grads


@pytest.mark.parametrize("loss", sorted(CASES))
def test_rayspeed_dpo_equals_trl(model_dir, tmp_path, loss):
    want, want_stats, want_grads, batch = _trl(model_dir, tmp_path, loss, CASES[loss])
    got, got_stats, got_grads = _rayspeed(model_dir, batch, loss, CASES[loss])
    torch.testing.assert_close(got, want, **TOL)
    assert set(got_stats) == set(want_stats)
    for key, value in want_stats.items():
        assert got_stats[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
    assert abs(want_stats["rewards/margins"]) > 1e-3 and any(g.abs().sum() > 0 for g in want_grads.values())
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, **TOL, msg=lambda m: f"{name}: {m}")


def _tp2_sp_rank(rank, world, model_dir, batch, loss, settings):
    """rayspeed's DPO loss, statistics and whole gradients (tp shards gathered) at tp2 with sequence parallelism."""
    from _hf_parity import init_deepspeed_gloo
    from rayspeed.model.hf_weights import load_hf_weights
    from rayspeed.model.transformer import Transformer
    from rayspeed.parallel.groups import ParallelGroups
    from rayspeed.parallel.layers import gather_full

    init_deepspeed_gloo()
    shape = _shape(model_dir)
    tp = ParallelGroups(dp=1, tp=2, pp=1).tp
    policy = Transformer(shape, tp=tp, sequence_parallel=True)
    reference = Transformer(shape, tp=tp, sequence_parallel=True)
    load_hf_weights(policy, model_dir, shape, tp=tp)
    load_hf_weights(reference, model_dir.parent / "reference", shape, tp=tp)
    ids, mask = batch["input_ids"], batch["completion_mask"]
    if ids.shape[1] % 2 == 0:  # sequence parallelism splits the model's input (ids[:, :-1]) evenly over tp
        ids, mask = (torch.nn.functional.pad(t, (0, 1)) for t in (ids, mask))
    value, stats = _dpo_pass(policy, reference, ids, mask, loss, settings)
    grads = {shape.family.tensor_names.hf_name(n): gather_full(p.grad, p, tp) for n, p in policy.named_parameters()}
    return value, stats, grads


def test_tp2_with_sequence_parallelism_equals_trl(model_dir, tmp_path):
    from _dist import run_distributed

    want, want_stats, want_grads, batch = _trl(model_dir, tmp_path, "sigmoid", CASES["sigmoid"])
    plain = {k: batch[k] for k in ("input_ids", "completion_mask")}
    for rank, (got, got_stats, got_grads) in enumerate(run_distributed(_tp2_sp_rank, 2, model_dir, plain, "sigmoid",
                                                                       CASES["sigmoid"], timeout_s=120)):
        torch.testing.assert_close(got, want, **TOL)
        for key, value in want_stats.items():
            assert got_stats[key] == pytest.approx(value, rel=1e-5, abs=1e-5), (rank, key)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


def _pp2_rank(rank, world, model_dir, batch, ref, loss, settings):
    """rayspeed's DPO loss, statistics and gradients through DeepSpeed's pipeline engine at pp2 (the last stage's
    loss_fn scores the pairs; each stage's gradients as they accumulate, before the tied embedding's reduction)."""
    from _hf_parity import init_deepspeed_gloo
    from rayspeed.config import parse
    from rayspeed.config.shape import ModelShape
    from rayspeed.engine.build import build_engine
    from rayspeed.engine.deepspeed_config import deepspeed_config
    from rayspeed.model.decoder import canonical_named_parameters
    from rayspeed.parallel.groups import ParallelGroups
    from rayspeed.train.dpo_objective import DpoObjective

    init_deepspeed_gloo()
    ids, mask = batch["input_ids"], batch["completion_mask"]
    pairs = ids.shape[0] // 2
    cfg = parse({"name": "dpo-pp", "model": {"pretrained": str(model_dir), "seq_len": 64},
                 "data": {"source": "files", "path": "unused.jsonl", "tokenizer": "model"},
                 "train": {"objective": "dpo", "dpo": {"loss": loss, **settings}, "global_batch_size": pairs,
                           "precision": "fp32", "warmup_steps": 0, "grad_clip": 0.0},
                 "parallel": dict(dp=1, tp=1, pp=2, zero_stage=0, micro_batch_size=pairs, grad_accum=1,
                                  sequence_parallel=False, activation_checkpointing="none"),
                 "cluster": {"num_workers": 2}})
    groups = ParallelGroups(1, 1, 2)
    engine, pipelined = build_engine(cfg, deepspeed_config(cfg), groups, torch.device("cpu"))
    assert pipelined
    grads = {}
    shape = ModelShape.from_config(cfg.model)
    for name, p in canonical_named_parameters(engine.module):
        hf_name = shape.family.tensor_names.hf_name(name)
        p.register_post_accumulate_grad_hook(lambda q, k=hf_name: grads.__setitem__(k, q.grad.detach().clone()))
    objective = DpoObjective(cfg, groups, torch.device("cpu"), engine=engine, pipelined=True)
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)

    class Rows:  # the batch's pairs as a split: what the reference pass scores
        def rows(self, positions):
            idx = list(positions) + [pairs + i for i in positions]
            return ids[idx, :-1].numpy(), labels[idx].numpy()

    engine.eval()
    scored = objective.score(engine, Rows(), [0, 1, 2], pairs)  # the reference pass's eval_batch (same shapes)
    engine.train()
    value = objective.train_batch(engine, [(ids[:, :-1], labels, ref)])
    return value.detach(), objective.metrics(None), grads, scored


def test_pp2_through_the_pipeline_engine_equals_trl(model_dir, tmp_path):
    from _dist import run_distributed

    want, want_stats, want_grads, batch = _trl(model_dir, tmp_path, "robust", CASES["robust"])
    plain = {k: batch[k] for k in ("input_ids", "completion_mask")}
    ref = _reference_logps(model_dir, plain)
    results = run_distributed(_pp2_rank, 2, model_dir, plain, ref, "robust", CASES["robust"], timeout_s=120)
    policy = _reference_logps(model_dir, plain, weights=model_dir)
    torch.testing.assert_close(results[1][3], torch.stack(policy.chunk(2), dim=1).double(), **TOL)
    assert not results[0][3].any()  # only the last stage scores
    grads = {}
    for rank, (got, got_stats, stage_grads, _) in enumerate(results):
        torch.testing.assert_close(got, want, **TOL)  # the engine broadcasts the last stage's loss
        for key, value in want_stats.items():
            assert got_stats[key] == pytest.approx(value, rel=1e-5, abs=1e-5), (rank, key)
        for name, g in stage_grads.items():  # the tied embedding: each stage's part, added as DeepSpeed does
            grads[name] = grads[name] + g if name in grads else g
    assert set(grads) == set(want_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, **TOL, msg=lambda m: f"{name}: {m}")


def _reference_logps(model_dir, batch, weights=None):
    from rayspeed.model.hf_weights import load_hf_weights
    from rayspeed.model.transformer import Transformer
    from rayspeed.objectives.dpo import sequence_logps

    shape = _shape(model_dir)
    reference = Transformer(shape)
    load_hf_weights(reference, weights or model_dir.parent / "reference", shape)
    ids, mask = batch["input_ids"], batch["completion_mask"]
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    with torch.no_grad():
        return sequence_logps(-reference(ids[:, :-1], labels, reduction="none"), labels)
