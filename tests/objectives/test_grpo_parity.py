"""GRPO parity with TRL 1.16 (fp32, rtol = atol = 1e-5): on a locally made Llama with its byte-level tokenizer, TRL's
GRPOTrainer scores a fixed set of completions (a rollout function hands them over, so both sides see the same
tokens; two reward functions with weights, one of which gives None for some completions) and computes its loss;
rayspeed's objective (rayspeed.objectives.grpo over rayspeed's Transformer on the same weights) gives the same
advantages, the same loss, the same clip and KL statistics and the same gradient of every weight, for every loss
variant, with and without the KL term, with clipped ratios (the sampling policy's log-probabilities moved off the
policy's) and for each way of scaling the rewards."""

from __future__ import annotations

import pytest
import torch

from _hf_models import LLAMA_TIED, save

TOL = dict(rtol=1e-5, atol=1e-5)
GENERATIONS = 4
MAX_COMPLETION = 12
# Equal token counts (byte tokenizer): rayspeed's Transformer is causal without a padding mask, so the prompts are not
# padded; the completions are right-padded and masked on both sides.
PROMPTS = ["Say hi:", "Count: ", "Name a:"]
COMPLETIONS = ["hi there", "hello", "hey!", "hi", "1 2 3 4 5", "1 2", "one two", "123",
               "apple", "a bee", "an ant, a cat", "ant"]
CASES = {
    "dapo": dict(loss_type="dapo"),
    "grpo": dict(loss_type="grpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dapo-beta": dict(loss_type="dapo", beta=0.05),
    "grpo-beta-clipped": dict(loss_type="grpo", beta=0.1, clipped=True),
    "dapo-clipped-asymmetric": dict(loss_type="dapo", epsilon=0.1, epsilon_high=0.3, clipped=True),
    "bnpo-scale-batch": dict(loss_type="bnpo", scale_rewards="batch"),
    "dr_grpo-scale-none": dict(loss_type="dr_grpo", scale_rewards="none"),
}


def reward_vowels(prompts, completions, **_):
    return [float(sum(c in "aeiou" for c in text)) for text in completions]


def reward_digits(prompts, completions, **_):
    # None where it does not apply: TRL leaves such a value out of the weighted sum (and a completion no function
    # scores out of the baseline).
    return [float(sum(c.isdigit() for c in text)) if p.startswith("Count") else None
            for p, text in zip(prompts, completions)]


WEIGHTS = [1.0, 0.5]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo")
    save(d / "llama", LLAMA_TIED, seed=4, tokenizer=True)
    save(d / "reference", LLAMA_TIED, seed=5, tokenizer=True)  # other weights: every KL term is nonzero
    return d / "llama"


def _rollout(tok):
    def rollout(prompts, trainer):
        # TRL repeats each prompt num_generations times, in order; completion i belongs to prompt i // GENERATIONS.
        completions = [COMPLETIONS[PROMPTS.index(p) * GENERATIONS + i % GENERATIONS] for i, p in enumerate(prompts)]
        return {"prompt_ids": [tok(p, add_special_tokens=False)["input_ids"] for p in prompts],
                "completion_ids": [tok(c, add_special_tokens=False)["input_ids"] for c in completions],
                "logprobs": [[0.0] * len(tok(c, add_special_tokens=False)["input_ids"]) for c in completions]}
    return rollout


def _trl(model_dir, tmp_path, case, peft=None):
    """TRL's loss, statistics, gradients, scored inputs and metrics. peft: (LoraConfig, adapter state): TRL makes a
    new adapter on the base (its reference the base, the adapter off), then holds the given adapter weights."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    settings = {k: v for k, v in case.items() if k != "clipped"}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.pad_token = tok.eos_token
    n = len(PROMPTS) * GENERATIONS
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                      per_device_train_batch_size=n, num_generations=GENERATIONS,
                      max_completion_length=MAX_COMPLETION, reward_weights=WEIGHTS, **settings)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_vowels, reward_digits], args=args,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]), processing_class=tok,
                          rollout_func=_rollout(tok), peft_config=None if peft is None else peft[0])
    if peft is not None:
        from peft import set_peft_model_state_dict

        assert not set_peft_model_state_dict(trainer.model, peft[1]).unexpected_keys
    if trainer.beta != 0.0 and trainer.ref_model is not None:  # a PeftModel's reference: its adapter turned off
        trainer.ref_model.load_state_dict(
            AutoModelForCausalLM.from_pretrained(str(model_dir.parent / "reference"), dtype=torch.float32)
            .state_dict())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.training_step, which this test does not run
    rows = [{"prompt": p} for p in PROMPTS for _ in range(GENERATIONS)]
    inputs = trainer._generate_and_score_completions(rows)
    if case.get("clipped"):
        with torch.no_grad():
            policy = trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), inputs["completion_ids"].size(1))[0]
        shift = torch.linspace(-0.5, 0.5, policy.numel()).view_as(policy)
        inputs["old_per_token_logps"] = policy + shift  # ratios from e^-0.5 to e^0.5: both sides clip
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    stats = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith(("clip_ratio/", "kl"))}
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), stats, grads, inputs, trainer._metrics["train"]


def settings_and_advantages(case):
    """rayspeed's settings for a case and its advantages over the fixed completions' rewards."""
    from rayspeed.objectives.grpo import GrpoSettings, advantages, rewards_of

    s = GrpoSettings(num_generations=GENERATIONS, loss=case["loss_type"], beta=case.get("beta", 0.0),
                     epsilon_low=case.get("epsilon", 0.2), epsilon_high=case.get("epsilon_high", case.get("epsilon",
                                                                                                            0.2)),
                     scale_rewards=case.get("scale_rewards", "group"), max_completion_length=MAX_COMPLETION)
    prompts = [p for p in PROMPTS for _ in range(GENERATIONS)]
    per_function = torch.tensor([[v if v is not None else float("nan") for v in f(prompts, COMPLETIONS)]
                                 for f in (reward_vowels, reward_digits)]).T
    return s, advantages(rewards_of(per_function, torch.tensor(WEIGHTS)), s)[0]


def _rayspeed(model_dir, inputs, case):
    from test_dpo_parity import _shape

    from rayspeed.model.hf_weights import load_hf_weights
    from rayspeed.model.transformer import Transformer
    from rayspeed.objectives.grpo import grpo_loss, mean_of

    s, advantage = settings_and_advantages(case)

    shape = _shape(model_dir)
    policy, reference = Transformer(shape), Transformer(shape)
    load_hf_weights(policy, model_dir, shape)
    load_hf_weights(reference, model_dir.parent / "reference", shape)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    start = inputs["prompt_ids"].size(1) - 1  # the first completion token's log-probability comes from here

    def completion_logps(model):
        return -model(ids[:, :-1], ids[:, 1:], reduction="none")[:, start:]

    logps = completion_logps(policy)
    with torch.no_grad():
        ref = completion_logps(reference)
    old = inputs.get("old_per_token_logps")
    old = logps.detach() if old is None else old
    mask = inputs["completion_mask"]
    value, sums, extremes = grpo_loss(logps, old, ref, advantage, mask, s, dapo_tokens=float(mask.sum()))
    value.backward()
    stats = {**mean_of(sums), **{k: float(v) for k, v in extremes.items()}}
    grads = {shape.family.tensor_names.hf_name(n): p.grad for n, p in policy.named_parameters()}
    return value.detach(), stats, grads, advantage


@pytest.mark.parametrize("case", sorted(CASES))
def test_rayspeed_grpo_equals_trl(model_dir, tmp_path, case):
    want, want_stats, want_grads, inputs, metrics = _trl(model_dir, tmp_path, CASES[case])
    assert torch.equal(inputs["prompt_mask"], torch.ones_like(inputs["prompt_mask"]))  # prompts not padded
    got, got_stats, got_grads, advantage = _rayspeed(model_dir, inputs, CASES[case])
    torch.testing.assert_close(advantage, inputs["advantages"], **TOL)
    assert advantage.abs().sum() > 1  # the rewards differ within groups: the loss and gradients are not zero
    torch.testing.assert_close(got, want, **TOL)
    assert set(got_stats) == set(want_stats)
    for key, value in want_stats.items():
        assert got_stats[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
    if CASES[case].get("clipped"):
        assert want_stats["clip_ratio/low_mean"] > 0 and want_stats["clip_ratio/high_mean"] > 0
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, **TOL, msg=lambda m: f"{name}: {m}")
