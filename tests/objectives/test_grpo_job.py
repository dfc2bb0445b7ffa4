"""A GRPO job through the worker path (tests/_inprocess.py: two gloo workers, dp2, ZeRO-2) on a locally made Llama
with its own tokenizer and prompt records {"prompt": "What is a plus b? ", "answer": a + b}, scored by the shipped
exact_number reward and a format check (a digit anywhere), weighted 1 and 0.5. Every step samples num_generations
completions per prompt with the policy as it is and logs TRL's metrics at every step, val/reward at each validation
and the samples table every 2 steps. The step-2 checkpoint, resumed under another job name, logs the uninterrupted
job's steps 3-4 to 1e-6: a step's sampling is seeded by (seed, step, rank), so a resume samples what the
uninterrupted job sampled. With a LoRA adapter and beta > 0 the reference is the base with the adapter turned off:
kl is 0 at step 1 (the adapter starts at zero) and grows once the adapter trains."""

from __future__ import annotations

import json
import shutil

import pytest

from _hf_models import LLAMA_TIED, save

METRICS = ("train/loss", "reward", "reward_std", "rewards/exact_number/mean", "rewards/exact_number/std",
           "rewards/matches_format/mean", "frac_reward_zero_std", "entropy", "completions/mean_length",
           "completions/clipped_ratio", "clip_ratio/region_mean", "rollout/tokens_per_s")


def _prompts(path):
    with open(path, "w") as f:
        for a in range(10):
            for b in range(4):
                f.write(json.dumps({"prompt": f"What is {a} plus {b}? ", "answer": a + b, "format": r".*\d.*"}) + "\n")


def _sets(tmp_path, name):
    return [f"model.pretrained={tmp_path / 'llama'}", f"name={name}", "model.seq_len=32", "data.source=files",
            f"data.path={tmp_path / 'prompts.jsonl'}", "data.tokenizer=model", f"data.cache_dir={tmp_path / 'cache'}",
            "data.val_fraction=0.1", "train.objective=grpo", "train.grpo.num_generations=4",
            "train.grpo.max_new_tokens=8", "train.grpo.rewards=[rayspeed.objectives.reward_examples:exact_number,"
            "rayspeed.objectives.reward_examples:matches_format]", "train.grpo.reward_weights=[1.0,0.5]",
            "train.grpo.temperature=1.5", "train.global_batch_size=16", "train.max_steps=4", "train.lr=1e-2",
            "train.warmup_steps=0", "train.eval_every_steps=2", "tracking.log_every_steps=1",
            "cluster.num_workers=2", "parallel.zero_stage=2", "tracking.charts_every_checkpoints=0",
            "resilience.checkpoint_every_steps=2"]


def test_a_grpo_job_logs_trls_metrics_and_resumes_its_sampling_exactly(tmp_path):
    from mlflow.tracking import MlflowClient

    from _cluster import ROOT, metric_history
    from _inprocess import run_inprocess

    save(tmp_path / "llama", LLAMA_TIED, seed=4, tokenizer=True)
    _prompts(tmp_path / "prompts.jsonl")
    config = str(ROOT / "configs" / "tiny-pretrained-cpu.yaml")
    sets = _sets(tmp_path, "grpo") + ["train.grpo.samples_every_steps=2"]
    s = run_inprocess(tmp_path, config, sets, workers=2)
    assert s["status"] == "finished" and s["layout"]["dp"] == 2 and s["layout"]["grad_accum"] * 2 * \
        s["layout"]["micro_batch_size"] == 16, s
    whole = {k: dict(metric_history(tmp_path, s["mlflow_run_id"], k)) for k in METRICS + ("val/reward",)}
    for k in METRICS:
        assert set(whole[k]) == {1, 2, 3, 4}, (k, whole[k])
    assert set(whole["val/reward"]) == {2, 4}
    assert all(v == 8.0 for v in whole["completions/mean_length"].values()) is False  # some completions end early
    samples = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").download_artifacts(
        s["mlflow_run_id"], "samples/step_00000002.json", str(tmp_path / "dl"))
    with open(samples) as f:
        table = json.load(f)
    assert table["columns"][:4] == ["prompt", "completion", "reward", "advantage"] and len(table["data"]) == 8
    assert whole["reward_std"][1] > 0 and abs(whole["train/loss"][3]) + abs(whole["train/loss"][4]) > 0, whole
    assert all(row[0].startswith("What is ") for row in table["data"])

    step2, = tmp_path.glob("**/grpo/checkpoint_step00000002")
    shutil.copytree(step2, step2.parent.parent / "grpo-resumed" / step2.name)
    r = run_inprocess(tmp_path, config, _sets(tmp_path, "grpo-resumed"), workers=2)
    assert r["status"] == "finished" and r["restarts"] == 0, r
    for k in METRICS[:-1]:
        resumed = dict(metric_history(tmp_path, r["mlflow_run_id"], k))
        assert set(resumed) == {3, 4}, (k, resumed)
        for step in (3, 4):
            assert resumed[step] == pytest.approx(whole[k][step], abs=1e-6), (k, step, resumed, whole[k])


def test_a_grpo_job_with_an_adapter_and_beta_measures_kl_to_the_base(tmp_path):
    from _cluster import ROOT, metric_history
    from _inprocess import run_inprocess

    save(tmp_path / "llama", LLAMA_TIED, seed=4, tokenizer=True)
    _prompts(tmp_path / "prompts.jsonl")
    sets = _sets(tmp_path, "grpo-lora") + ["train.grpo.beta=0.1", "model.adapter.type=lora", "model.adapter.rank=4",
                                           "train.max_steps=3", "train.eval_every_steps=0", "train.grpo.loss=grpo"]
    s = run_inprocess(tmp_path, str(ROOT / "configs" / "tiny-pretrained-cpu.yaml"), sets, workers=2)
    assert s["status"] == "finished", s
    kl = dict(metric_history(tmp_path, s["mlflow_run_id"], "kl"))
    assert kl[1] == pytest.approx(0.0, abs=1e-7) and kl[3] > 1e-6, kl


def test_a_reward_that_raises_on_one_rank_ends_the_job_at_once_naming_it(tmp_path, monkeypatch):
    """Rank 1's reward function raises at the second step while rank 0's scores: every rank stops with the one
    message (none waits for the others' rewards), the job ends with status reward_failed and no restart."""
    from _cluster import ROOT
    from _inprocess import run_inprocess

    save(tmp_path / "llama", LLAMA_TIED, seed=4, tokenizer=True)
    _prompts(tmp_path / "prompts.jsonl")
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "fixtures" / "hooks"))  # spawned workers get this sys.path
    sets = [s for s in _sets(tmp_path, "grpo-raises") if not s.startswith("train.grpo.reward")]
    sets += ["train.grpo.rewards=[failing_rewards:fails_on_rank_one]", "resilience.max_failures=3"]
    s = run_inprocess(tmp_path, str(ROOT / "configs" / "tiny-pretrained-cpu.yaml"), sets, workers=2)
    assert s["status"] == "reward_failed" and s["steps"] == 1 and s["restarts"] == 0, s
    assert "reward function fails_on_rank_one raised ValueError: no answer checker for this record" in s["error"], s
    assert "What is " in s["error"]  # the prompt it raised on
