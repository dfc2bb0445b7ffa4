"""A DPO job through the worker path (tests/_inprocess.py: two gloo workers, dp2, ZeRO-2) on a locally made Llama
with its own tokenizer and a small standard-form preference set: the reference is precomputed with the initial
weights, so step 1's loss is ln 2 and its rewards are zero exactly (TRL's reading of a policy equal to its
reference); training raises rewards/accuracies and rewards/margins and lowers val/loss (the DPO loss on the
held-out pairs) below ln 2; the reference file is written once beside the token cache, and the same job through a
two-stage pipeline reads it and trains as the dp job did; at ZeRO-3 with a cache of its own, the reference pass
scores the same numbers and the job trains as the dp job did. Elasticity: the dp job's step-4 checkpoint, resumed
by one worker (dp1, twice the examples per rank for the same global batch: DeepSpeed's universal checkpoint carries
the ZeRO-2 partitions across), continues the dp2 job's losses, rewards and validation to 1e-5 (the pairs and their
reference log-probabilities are global, not a rank's)."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from _hf_models import LLAMA_TIED, save

ANSWERS = [("blue", "green"), ("four", "seven"), ("Paris", "Rome"), ("ice", "fire")]


def _pairs(path, n=48):
    with open(path, "w") as f:
        for i in range(n):
            good, bad = ANSWERS[i % len(ANSWERS)]
            f.write(json.dumps({"prompt": f"Question {i}: ", "chosen": f"The answer is {good}.",
                                "rejected": f"The answer is {bad}, maybe."}) + "\n")


def _global_batch(layout):
    return layout["dp"] * layout["micro_batch_size"] * layout["grad_accum"]


def test_a_dpo_job_starts_at_ln2_and_learns_the_preferences(tmp_path):
    from _cluster import ROOT, metric_history
    from _inprocess import run_inprocess

    save(tmp_path / "llama", LLAMA_TIED, seed=4, tokenizer=True)
    _pairs(tmp_path / "prefs.jsonl")
    sets = [f"model.pretrained={tmp_path / 'llama'}", "name=tiny-dpo", "model.seq_len=48", "data.source=files",
            f"data.path={tmp_path / 'prefs.jsonl'}", "data.tokenizer=model", f"data.cache_dir={tmp_path / 'cache'}",
            "data.val_fraction=0.2",
            "train.objective=dpo", "train.dpo.beta=0.5", "train.max_steps=8", "train.lr=3e-3", "train.min_lr=3e-4",
            "train.warmup_steps=0", "train.eval_every_steps=4", "tracking.log_every_steps=1",
            "cluster.num_workers=2", "parallel.tp=1", "parallel.pp=1", "parallel.zero_stage=2",
            "tracking.charts_every_checkpoints=0", "resilience.checkpoint_every_steps=4"]
    summary = run_inprocess(tmp_path, str(ROOT / "configs" / "tiny-pretrained-cpu.yaml"), sets, workers=2)
    assert summary["status"] == "finished" and summary["layout"]["dp"] == 2, summary
    run_id = summary["mlflow_run_id"]

    def history(key):
        return dict(metric_history(tmp_path, run_id, key))

    loss, acc, margins = history("train/loss"), history("rewards/accuracies"), history("rewards/margins")
    assert loss[1] == pytest.approx(math.log(2), abs=1e-6)
    assert margins[1] == pytest.approx(0.0, abs=1e-6) and acc[1] == 0.0
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert set(history(key)) == set(range(1, 9)), key
    assert acc[8] >= 0.75 and margins[8] > 0.1 and loss[8] < loss[1], (acc, margins, loss)
    val = history("val/loss")
    assert set(val) == {4, 8} and val[8] < math.log(2) - 0.05, val
    assert history("val/rewards/accuracies")[8] >= 0.75

    # The dp job's step-4 checkpoint under another job name, resumed by a world of one.
    step4, = tmp_path.glob("**/tiny-dpo/checkpoint_step00000004")
    shutil.copytree(step4, step4.parent.parent / "tiny-dpo-dp1" / step4.name)
    resized = run_inprocess(tmp_path, str(ROOT / "configs" / "tiny-pretrained-cpu.yaml"),
                            sets + ["name=tiny-dpo-dp1"], workers=1)
    assert resized["status"] == "finished" and resized["layout"]["dp"] == 1, resized
    assert _global_batch(resized["layout"]) == _global_batch(summary["layout"]), resized["layout"]
    for key in ("train/loss", "rewards/accuracies", "rewards/margins", "logps/chosen", "val/loss"):
        got, want = dict(metric_history(tmp_path, resized["mlflow_run_id"], key)), history(key)
        assert set(got) == {s for s in want if s > 4}, (key, got)
        assert [got[s] for s in sorted(got)] == pytest.approx([want[s] for s in sorted(got)], rel=1e-5, abs=1e-5), key

    cache = list((tmp_path / "cache").glob("reference-*.npy"))
    assert len(cache) == 2, cache  # the training and the held-out pairs
    stamps = {p: p.stat().st_mtime_ns for p in cache}
    # The same job through a two-stage pipeline: it reads the reference file (the same weights and pairs) and
    # trains on the same global batches, so its losses are the dp job's.
    piped = run_inprocess(tmp_path, str(ROOT / "configs" / "tiny-pretrained-cpu.yaml"),
                          sets + ["name=tiny-dpo-pp", "train.max_steps=2", "parallel.pp=2", "parallel.zero_stage=1",
                                  "train.eval_every_steps=0"], workers=2)
    assert piped["status"] == "finished" and piped["layout"]["pp"] == 2, piped
    assert {p: p.stat().st_mtime_ns for p in cache} == stamps  # read, not scored again
    piped_loss = dict(metric_history(tmp_path, piped["mlflow_run_id"], "train/loss"))
    assert piped_loss[1] == pytest.approx(math.log(2), abs=1e-6)
    assert piped_loss[2] == pytest.approx(loss[2], rel=1e-5, abs=1e-5)
    piped_acc = dict(metric_history(tmp_path, piped["mlflow_run_id"], "rewards/accuracies"))
    assert piped_acc[2] == pytest.approx(acc[2], abs=1e-6)

    # ZeRO-3 with a cache of its own: its reference pass gathers every layer over dp, so both ranks run as many
    # forwards (the held-out pairs do not split evenly); it scores what the dp job scored and trains as it did.
    zero3 = run_inprocess(tmp_path, str(ROOT / "configs" / "tiny-pretrained-cpu.yaml"),
                          sets + ["name=tiny-dpo-z3", "train.max_steps=2", "parallel.zero_stage=3",
                                  f"data.cache_dir={tmp_path / 'cache-z3'}", "train.eval_every_steps=0"], workers=2)
    assert zero3["status"] == "finished" and zero3["layout"]["zero_stage"] == 3, zero3
    scored = {p.name: np.load(p) for p in (tmp_path / "cache-z3").glob("reference-*.npy")}
    assert set(scored) == {p.name for p in cache}  # the same keys: the layout is not part of them
    for p in cache:
        np.testing.assert_allclose(scored[p.name], np.load(p), rtol=1e-5, atol=1e-5)
    z3_loss = dict(metric_history(tmp_path, zero3["mlflow_run_id"], "train/loss"))
    assert z3_loss[2] == pytest.approx(loss[2], rel=1e-5, abs=1e-5)
