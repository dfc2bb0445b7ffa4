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


def _rayspeed(model_dir, batch, loss, settings):
    from types import SimpleNamespace

    from rayspeed.config.hf_config import model_keys_from_hf, read_pretrained_config
    from rayspeed.config.shape import ModelShape
    from rayspeed.model.hf_weights import load_hf_weights
    from rayspeed.model.transformer import Transformer
    from rayspeed.objectives.dpo import DpoSettings, completion_lengths, dpo_loss, sequence_logps

    hf, path = read_pretrained_config(model_dir)
    keys, problems = model_keys_from_hf(hf, str(path), seq_len=64)
    assert not problems
    shape = ModelShape.from_config(SimpleNamespace(**keys, seq_len=64))
    policy, reference = Transformer(shape), Transformer(shape)
    load_hf_weights(policy, model_dir, shape)
    load_hf_weights(reference, model_dir.parent / "reference", shape)
    ids, mask = batch["input_ids"], batch["completion_mask"]
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    logps = sequence_logps(-policy(ids[:, :-1], labels, reduction="none"), labels)
    with torch.no_grad():
        ref = sequence_logps(-reference(ids[:, :-1], labels, reduction="none"), labels)
    value, stats = dpo_loss(logps, ref, completion_lengths(labels), DpoSettings(loss=loss, **settings))
    value.backward()
    grads = {shape.family.tensor_names.hf_name(n): p.grad for n, p in policy.named_parameters()}
    return value.detach(), {k: float(v.mean()) for k, v in stats.items()}, grads


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
