"""GRPO parity with TRL 1.16 under the layouts (fp32, rtol = atol = 1e-5), on the completions, rewards and old
log-probabilities of tests/objectives/test_grpo_parity.py, with the KL term and with both clip bounds active:
- tp2 with sequence parallelism: rayspeed's Transformer split over two tensor-parallel ranks (sequence parallelism
  splits the rows' positions; a pad position is added past the completions where their count is odd) gives TRL's
  loss, clip and KL statistics and every gradient (the tp shards gathered);
- LoRA on every linear layer: TRL makes a new adapter from a LoraConfig (its reference the base with the adapter
  off, as rayspeed's) and holds rayspeed's adapter weights (B drawn nonzero, as after some training); the loss, the
  statistics (kl > 0) and every adapter gradient equal peft's.
A new adapter is also TRL's reference only while it is new: given a PeftModel to continue, TRL 1.16 keeps a copy
of the adapter's starting weights as the reference ("ref"), where rayspeed's reference stays the base."""

from __future__ import annotations

import pytest
import torch
from test_grpo_parity import CASES, _trl, settings_and_advantages

TOL = dict(rtol=1e-5, atol=1e-5)
TP_CASES = ["dapo-beta", "grpo-beta-clipped"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from _hf_models import LLAMA_TIED, save

    d = tmp_path_factory.mktemp("grpo-tp")
    save(d / "llama", LLAMA_TIED, seed=4, tokenizer=True)
    save(d / "reference", LLAMA_TIED, seed=5, tokenizer=True)
    return d / "llama"


def _tp2_sp_rank(rank, world, model_dir, rows, case):
    from test_dpo_parity import _shape

    from _hf_parity import init_deepspeed_gloo
    from rayspeed.model.hf_weights import load_hf_weights
    from rayspeed.model.transformer import Transformer
    from rayspeed.objectives.grpo import grpo_loss, mean_of
    from rayspeed.parallel.groups import ParallelGroups
    from rayspeed.parallel.layers import gather_full

    init_deepspeed_gloo()
    s, advantage = settings_and_advantages(case)
    shape = _shape(model_dir)
    tp = ParallelGroups(dp=1, tp=2, pp=1).tp
    policy = Transformer(shape, tp=tp, sequence_parallel=True)
    reference = Transformer(shape, tp=tp, sequence_parallel=True)
    load_hf_weights(policy, model_dir, shape, tp=tp)
    load_hf_weights(reference, model_dir.parent / "reference", shape, tp=tp)
    ids, mask, old = rows["ids"], rows["completion_mask"], rows.get("old")
    width = mask.shape[1]
    if ids.shape[1] % 2 == 0:  # sequence parallelism splits the model's input (ids[:, :-1]) evenly over tp
        ids = torch.nn.functional.pad(ids, (0, 1))
    start = rows["prompt_width"] - 1

    def completion_logps(model):
        return -model(ids[:, :-1], ids[:, 1:], reduction="none")[:, start:start + width]

    logps = completion_logps(policy)
    with torch.no_grad():
        ref = completion_logps(reference)
    old = logps.detach() if old is None else old
    value, sums, extremes = grpo_loss(logps, old, ref, advantage, mask, s, dapo_tokens=float(mask.sum()))
    value.backward()
    stats = {**mean_of(sums), **{k: float(v) for k, v in extremes.items()}}
    grads = {shape.family.tensor_names.hf_name(n): gather_full(p.grad, p, tp) for n, p in policy.named_parameters()}
    return value.detach(), stats, grads


@pytest.mark.parametrize("case", TP_CASES)
def test_tp2_with_sequence_parallelism_equals_trl(model_dir, tmp_path, case):
    from _dist import run_distributed

    want, want_stats, want_grads, inputs, _ = _trl(model_dir, tmp_path, CASES[case])
    rows = {"ids": torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            "completion_mask": inputs["completion_mask"], "prompt_width": inputs["prompt_ids"].size(1)}
    if "old_per_token_logps" in inputs and inputs["old_per_token_logps"] is not None:
        rows["old"] = inputs["old_per_token_logps"]
    results = run_distributed(_tp2_sp_rank, 2, model_dir, rows, CASES[case], timeout_s=120)
    for rank, (got, got_stats, got_grads) in enumerate(results):
        torch.testing.assert_close(got, want, **TOL)
        for key, value in want_stats.items():
            assert got_stats[key] == pytest.approx(value, rel=1e-5, abs=1e-5), (rank, key)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


def _adapted(model_dir):
    """rayspeed's Transformer with LoRA on every linear layer, each B drawn whole from its name (as after some
    training: B starts at zero, and A's gradients with it), and peft's LoraConfig with those adapter weights."""
    from peft import LoraConfig
    from test_dpo_parity import _shape

    from rayspeed.adapters import peft_files
    from rayspeed.adapters.attach import add_adapters
    from rayspeed.adapters.lora import LoraAdapter
    from rayspeed.config.schema import AdapterConfig
    from rayspeed.model.hf_weights import load_hf_weights
    from rayspeed.model.transformer import Transformer
    from rayspeed.parallel.layers import full_normal

    shape = _shape(model_dir)
    adapter = AdapterConfig(type="lora", rank=4, alpha=8.0, targets=["all"])
    model = Transformer(shape)
    load_hf_weights(model, model_dir, shape)
    add_adapters(model, adapter, None, False, seed=1)
    for m in model.modules():
        if isinstance(m, LoraAdapter):
            m.lora_B.data.copy_(full_normal((m.out_features, m.rank), 0.1, 7, m.name))
    config = LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha,
                        target_modules=peft_files.target_modules(adapter, shape))
    return shape, model, (config, peft_files.peft_state(model.full_state_dict(), shape))


@pytest.mark.parametrize("case", TP_CASES)
def test_lora_with_the_base_as_reference_equals_trl_with_peft(model_dir, tmp_path, case):
    from rayspeed.adapters import peft_files
    from rayspeed.adapters.lora import adapters_disabled
    from rayspeed.objectives.grpo import grpo_loss, mean_of

    shape, model, peft = _adapted(model_dir)
    want, want_stats, want_grads, inputs, _ = _trl(model_dir, tmp_path, CASES[case], peft=peft)
    s, advantage = settings_and_advantages(CASES[case])
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    start = inputs["prompt_ids"].size(1) - 1

    def completion_logps():
        return -model(ids[:, :-1], ids[:, 1:], reduction="none")[:, start:]

    logps = completion_logps()
    with torch.no_grad(), adapters_disabled(model):
        ref = completion_logps()
    old = inputs.get("old_per_token_logps")
    old = logps.detach() if old is None else old
    mask = inputs["completion_mask"]
    got, sums, extremes = grpo_loss(logps, old, ref, advantage, mask, s, dapo_tokens=float(mask.sum()))
    got.backward()
    torch.testing.assert_close(got.detach(), want, **TOL)
    stats = {**mean_of(sums), **{k: float(v) for k, v in extremes.items()}}
    assert want_stats["kl"] > 0
    for key, value in want_stats.items():
        assert stats[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(peft_files.is_adapter(n) for n in grads)
    saved = {n.replace(".default.", "."): g for n, g in want_grads.items()}
    assert len(saved) == len(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, saved[peft_files.peft_key(name, shape)], **TOL, msg=lambda m: f"{name}: {m}")
