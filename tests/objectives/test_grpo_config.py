"""train.objective: grpo and train.grpo: every setting or combination a GRPO job cannot run is one message naming
the key and the fix (exit 2 from the CLI, no traceback, nothing written); the planner keeps a GRPO job to the layouts
its sampling is built for; a prompt record without a prompt is named by file and line; a reward function that does
not import stops the launch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rayspeed.config.load import load
from rayspeed.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
GRPO = ["train.objective=grpo", "data.source=files", "data.path=prompts.jsonl", "data.tokenizer=tok",
        "train.grpo.rewards=[rayspeed.objectives.reward_examples:exact_number]", "train.grpo.num_generations=4",
        "train.grpo.max_new_tokens=32", "train.global_batch_size=16"]

CASES = {
    "train.grpo.loss: cispo is one of TRL 1.16's loss types rayspeed does not build": ["train.grpo.loss=cispo"],
    "train.grpo.loss: 'ppo' is not one of dapo, grpo, dr_grpo, bnpo": ["train.grpo.loss=ppo"],
    "train.grpo.scale_rewards: 'std' is not one of group, batch, none": ["train.grpo.scale_rewards=std"],
    "train.grpo.num_generations: a group needs at least 2": ["train.grpo.num_generations=1"],
    "train.global_batch_size: 18 completions is not a whole number of groups": ["train.global_batch_size=18"],
    "train.grpo.max_new_tokens: 512 must be at least 1 and leave room": ["train.grpo.max_new_tokens=512"],
    "train.grpo.temperature: must be > 0": ["train.grpo.temperature=0"],
    "train.grpo.top_p: must be in (0, 1]": ["train.grpo.top_p=1.5"],
    "train.grpo.beta: must be >= 0": ["train.grpo.beta=-0.1"],
    "train.grpo.num_iterations: 2: several updates per generation batch are not built yet": [
        "train.grpo.num_iterations=2"],
    "train.grpo.rewards: name at least one reward function": ["train.grpo.rewards=[]"],
    "train.grpo.rewards: 'exact' is not `package.module:function`": ["train.grpo.rewards=[exact]"],
    "train.grpo.reward_weights: 2 weights for 1 reward functions": ["train.grpo.reward_weights=[1.0,2.0]"],
    "train.grpo.rollout.colocate: false (separate rollout workers) is not built yet": [
        "train.grpo.rollout.colocate=false"],
    "data.source: python-stdlib holds no prompts": ["data.source=python-stdlib", "data.path=null"],
    "data.tokenizer: GRPO needs a transformers tokenizer": ["data.tokenizer=bytes"],
    "data.document_masking: a GRPO row is one prompt": ["data.document_masking=true"],
    "parallel.tp: 2 with train.objective: grpo": ["parallel.tp=2"],
    "parallel.pp: 2 with train.objective: grpo": ["parallel.pp=2"],
    "parallel.zero_stage: 3 with train.objective: grpo": ["parallel.zero_stage=3"],
    "model.num_experts: GRPO on a mixture of experts is not built yet": ["model.num_experts=4"],
}


@pytest.mark.parametrize("message", sorted(CASES))
def test_what_a_grpo_job_cannot_run_is_named(message):
    with pytest.raises(ConfigError) as e:
        load(TINY, GRPO + CASES[message])
    assert message in str(e.value), str(e.value)


def test_grpo_keys_without_the_grpo_objective_are_named_and_defaults_are_trls():
    with pytest.raises(ConfigError, match="train.grpo.beta is set but train.objective is sft: set train.objective: "
                                          "grpo"):
        load(TINY, ["train.grpo.beta=0.3"])
    g = load(TINY, GRPO).train.grpo
    assert (g.loss, g.beta, g.epsilon, g.temperature, g.scale_rewards, g.num_iterations) == \
        ("dapo", 0.0, 0.2, 1.0, "group", 1)


def test_the_planner_keeps_a_grpo_job_to_data_parallelism_below_zero_3():
    from rayspeed.planner import resolve

    cfg, _ = resolve(load(TINY, [*GRPO, "cluster.num_workers=4"]), world_size=4)
    p = cfg.parallel
    assert (p.dp, p.tp, p.pp, p.cp) == (4, 1, 1, 1) and p.zero_stage in (0, 1, 2), p


def test_a_bad_prompt_record_and_a_missing_reward_are_exit_2_naming_them(tmp_path):
    from _hf_models import LLAMA_TIED, save

    save(tmp_path / "llama", LLAMA_TIED, seed=1, tokenizer=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 1 plus 2? ", "answer": 3}) + "\n" + json.dumps({"q": "x"}) + "\n")
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "RAYSPEED_HOME": str(home),
           "PYTHONPATH": str(ROOT / "platform")}
    base = ["train", "--config", str(ROOT / "configs" / "tiny-pretrained-cpu.yaml"), "--launcher", "local",
            *(f"--set={s}" for s in GRPO),
            f"--set=data.path={prompts}", f"--set=model.pretrained={tmp_path / 'llama'}",
            "--set=data.tokenizer=model",
            "--set=model.seq_len=64", "--set=train.global_batch_size=4", "--set=cluster.num_workers=1"]
    for extra, said in (([], f"{prompts}:2: a prompt record needs a 'prompt'"),
                        (["--set=train.grpo.rewards=[nowhere.rewards:exact]"],
                         "train.grpo.rewards: 'nowhere.rewards:exact' cannot be imported here")):
        r = subprocess.run([sys.executable, "-m", "rayspeed", *base, *extra], capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert said in r.stderr, r.stderr[-3000:]
    assert list(home.iterdir()) == []


def test_retraining_a_grpo_job_is_exit_2_with_the_reason(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAYSPEED_HOME": str(tmp_path),
           "PYTHONPATH": str(ROOT / "platform")}
    r = subprocess.run([sys.executable, "-m", "rayspeed", "retrain", "--config", TINY, *(f"--set={s}" for s in GRPO),
                        "--launcher", "local"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "train.objective: grpo: retraining promotes on a re-evaluated next-token val/loss" in r.stderr + r.stdout


def test_every_prompt_may_train_without_a_validation_share():
    assert load(TINY, [*GRPO, "data.val_fraction=0"]).data.val_fraction == 0
    with pytest.raises(ConfigError, match="data.val_fraction: must be in"):
        load(TINY, ["data.val_fraction=0"])
