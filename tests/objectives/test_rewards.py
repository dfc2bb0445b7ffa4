"""Reward functions as TRL 1.16 calls them: the same functions (one reading a record's column and the trainer state
and logging an extra column and a metric, one returning None where it does not apply, one `async def`) score the
same completions to the same values through rayspeed.objectives.rewards.score as through GRPOTrainer's own
`_calculate_rewards`; a function that raises or miscounts is one RewardError naming it."""

from __future__ import annotations

import math

import pytest
import torch

from _hf_models import LLAMA_TIED, save

PROMPTS = ["2 + 2 = ", "2 + 2 = ", "3 x 3 = ", "3 x 3 = "]
COMPLETIONS = ["4", "five", "9", " 9!"]
ANSWERS = ["4", "4", "9", "9"]


def exact(prompts, completions, answer, trainer_state, log_extra, log_metric, **_):
    log_extra("answer", list(answer))
    log_metric("exact/step", float(trainer_state.global_step))
    return [1.0 + trainer_state.global_step if c.strip(" !") == a else 0.0 for c, a in zip(completions, answer)]


def only_squares(prompts, completions, completion_ids, **_):
    return [float(len(ids)) if "x" in p else None for p, ids in zip(prompts, completion_ids)]


async def shouts(prompts, completions, **_):
    return [float(c.endswith("!")) for c in completions]


FUNCTIONS = [exact, only_squares, shouts]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    d = tmp_path_factory.mktemp("rewards")
    save(d / "llama", LLAMA_TIED, seed=4, tokenizer=True)
    tok = AutoTokenizer.from_pretrained(str(d / "llama"))
    tok.pad_token = tok.eos_token
    args = GRPOConfig(output_dir=str(d / "trl"), report_to=[], use_cpu=True, bf16=False, num_generations=2,
                      per_device_train_batch_size=4)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(d / "llama")), reward_funcs=FUNCTIONS,
                          args=args, processing_class=tok,
                          train_dataset=Dataset.from_list([{"prompt": p, "answer": a} for p, a in
                                                           zip(PROMPTS, ANSWERS)]))
    trainer.state.global_step = 3
    return trainer


def test_score_equals_trl(trainer):
    from rayspeed.objectives.rewards import RewardLog, TrainerState, score

    ids = [list(c.encode()) for c in COMPLETIONS]
    inputs = [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, ANSWERS)]
    want = trainer._calculate_rewards(inputs, PROMPTS, COMPLETIONS, ids)
    log = RewardLog()
    got = score(FUNCTIONS, PROMPTS, COMPLETIONS, ids, {"answer": ANSWERS}, TrainerState(global_step=3), log)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    assert got[0, 0] == 4.0 and math.isnan(got[0, 1]) and got[3, 2] == 1.0  # the step, a None, the async one
    assert log.extra == {"answer": ANSWERS} and log.metric_means() == {"exact/step": 3.0}


def test_a_failing_function_is_one_error_naming_it():
    from rayspeed.objectives.rewards import RewardError, RewardLog, TrainerState, score

    def broken(prompts, completions, **_):
        raise KeyError("answer")

    def short(prompts, completions, **_):
        return [1.0]

    async def wordy(prompts, completions, **_):
        return ["yes"] * len(completions)

    args = (PROMPTS, COMPLETIONS, [[1]] * 4, {}, TrainerState(), RewardLog())
    with pytest.raises(RewardError, match=r"reward function broken raised KeyError: 'answer' .*'2 \+ 2 = '"):
        score([broken], *args)
    with pytest.raises(RewardError, match="reward function short returned 1 values for 4 completions"):
        score([short], *args)
    with pytest.raises(RewardError, match=r"reward function wordy returned 'yes' for completion 0"):
        score([wordy], *args)


def test_load_reward_names_what_is_wrong():
    from rayspeed.objectives.rewards import load_reward

    assert load_reward("math:sqrt") is math.sqrt
    with pytest.raises(ImportError, match="not package.module:function"):
        load_reward("math.sqrt")
    with pytest.raises(ImportError, match="math has no square"):
        load_reward("math:square")
    with pytest.raises(TypeError, match="math:pi is not a function"):
        load_reward("math:pi")
