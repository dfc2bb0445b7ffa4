"""GRPO in DeepSpeed's step against TRL 1.16's whole-batch loss (fp32, rtol = atol = 1e-5): the twelve completions of
tests/objectives/test_grpo_parity.py split over two data-parallel ranks and two micro-batches each (ZeRO-0, gradient
accumulation 2) through rayspeed.train.grpo_objective give, after DeepSpeed's averaging, TRL's gradient of every
weight and its clip and KL statistics (summed over micro-batches and ranks), for dapo (its token count over ranks
and accumulation steps), grpo and dr_grpo, with the KL term and with clipped ratios. The rows are
rayspeed.train.grpo_rollout.pack's: prompt and completion, the completion's labels masked in."""

from __future__ import annotations

import pytest
import torch
from test_grpo_parity import CASES, COMPLETIONS, GENERATIONS, MAX_COMPLETION, PROMPTS, _trl

TOL = dict(rtol=1e-5, atol=1e-5)
STEP_CASES = ["dapo", "grpo", "dr_grpo", "dapo-beta", "grpo-beta-clipped"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from _hf_models import LLAMA_TIED, save

    d = tmp_path_factory.mktemp("grpo-step")
    save(d / "llama", LLAMA_TIED, seed=4, tokenizer=True)
    save(d / "reference", LLAMA_TIED, seed=5, tokenizer=True)
    return d / "llama"


def _rank(rank, world, model_dir, rows, case):
    import deepspeed
    from test_dpo_parity import _shape

    from _hf_parity import init_deepspeed_gloo
    from rayspeed.model.hf_weights import load_hf_weights
    from rayspeed.model.transformer import Transformer
    from rayspeed.objectives.grpo import GrpoSettings
    from rayspeed.train.grpo_objective import GrpoObjective, completion_logps, dapo_tokens

    init_deepspeed_gloo()
    import torch.distributed as dist

    shape = _shape(model_dir)
    policy, reference = Transformer(shape), Transformer(shape)
    load_hf_weights(policy, model_dir, shape)
    load_hf_weights(reference, model_dir.parent / "reference", shape)
    ids, mask, advantage, old = rows
    n = ids.shape[0] // world
    mine = slice(rank * n, (rank + 1) * n)
    ids, mask, advantage = ids[mine], mask[mine], advantage[mine]
    old = None if old is None else old[mine]
    settings = GrpoSettings(num_generations=GENERATIONS, loss=case["loss_type"], beta=case.get("beta", 0.0),
                            max_completion_length=MAX_COMPLETION)
    grad_accum, micro = 2, n // 2
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": grad_accum,
              "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=policy, optimizer=torch.optim.SGD(policy.parameters(), lr=0.0),
                                           config=config)
    group = dist.group.WORLD
    objective = GrpoObjective(settings, group, torch.device("cpu"))
    tokens = dapo_tokens(float(mask.sum()), group, world, grad_accum, torch.device("cpu"))
    with torch.no_grad():
        ref = completion_logps(reference, ids) if settings.beta else None
    for i in range(0, n, micro):
        part = slice(i, i + micro)
        mb = (ids[part], mask[part], advantage[part], None if old is None else old[part],
              None if ref is None else ref[part], tokens)
        engine.backward(objective.loss(engine, mb, None).trained)
        if i + micro < n:
            engine.step()  # counts the micro-batch; at the boundary (the last) the gradients are read before it
    assert engine.is_gradient_accumulation_boundary()
    grads = {shape.family.tensor_names.hf_name(name): p.grad.detach().clone()
             for name, p in policy.named_parameters()}
    return grads, objective.metrics(None)


def _rows(inputs):
    """TRL's inputs as pack's rows: the completion's per-token values at its label positions."""
    from rayspeed.train.grpo_rollout import pack

    tok_prompts = inputs["prompt_ids"].tolist()
    completions = [[t for t, m in zip(row, mask) if m] for row, mask in
                   zip(inputs["completion_ids"].tolist(), inputs["completion_mask"].tolist())]
    ids, mask = pack(tok_prompts, completions, 0)
    start = inputs["prompt_ids"].shape[1] - 1
    width = inputs["completion_ids"].shape[1]
    torch.testing.assert_close(mask[:, start:start + width], inputs["completion_mask"].float())
    old = None
    if inputs.get("old_per_token_logps") is not None:
        old = torch.zeros_like(mask)
        old[:, start:start + width] = inputs["old_per_token_logps"]
    return ids, mask, inputs["advantages"], old


@pytest.mark.parametrize("case", STEP_CASES)
def test_two_ranks_two_micro_batches_give_trls_whole_batch_gradient(model_dir, tmp_path, case):
    from _dist import run_distributed

    assert len(COMPLETIONS) == len(PROMPTS) * GENERATIONS == 12
    _, want_stats, want_grads, inputs, _ = _trl(model_dir, tmp_path, CASES[case])
    for rank, (grads, stats) in enumerate(run_distributed(_rank, 2, model_dir, _rows(inputs), CASES[case],
                                                          timeout_s=120)):
        for key, value in want_stats.items():
            assert stats[key] == pytest.approx(value, rel=1e-5, abs=1e-5), (rank, key)
        for name, grad in want_grads.items():
            torch.testing.assert_close(grads[name], grad, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")
