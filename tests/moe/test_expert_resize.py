"""An elastic resize across an ep change, through the worker path (tests/_inprocess.py, gloo, no Ray): a locally made
Qwen3-MoE-style checkpoint trained by four workers at ep 4 (one expert per rank, ZeRO-2); its step-2 checkpoint,
resumed by two workers at ep 2 (two experts per rank, two micro-batches per step for the same global batch), is
converted by DeepSpeed's universal checkpoint with rayspeed's expert layout (the expert stacks concatenated in ep
rank order and cut again for the new ep, every other weight taken once) and continues the uninterrupted run's
language-model loss and balance loss to 1e-5. Parameters and Adam moments travel, or step 3 would differ. The
micro-batch stays 2 rows: the balance loss pools its statistics over one forward's rows (transformers' definition
per call), so forwards of other rows give another balance loss, although the language-model loss is the same."""

from __future__ import annotations

import shutil

import pytest
import torch


def test_a_step_2_checkpoint_at_ep4_resumes_at_ep2_with_the_uninterrupted_losses(tmp_path):
    import transformers

    from _cluster import ROOT, metric_history
    from _inprocess import run_inprocess

    torch.manual_seed(3)
    config = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=128, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=24, mlp_only_layers=[1], tie_word_embeddings=False)
    model_dir = tmp_path / "tiny-qwen3-moe"
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(model_dir)
    sets = [f"model.pretrained={model_dir}", "name=tiny-moe", "model.seq_len=32", "train.global_batch_size=8",
            "train.max_steps=4", "train.lr=1e-3", "train.warmup_steps=0", "tracking.log_every_steps=1",
            "parallel.tp=1", "parallel.pp=1", "parallel.zero_stage=2", "parallel.micro_batch_size=2",
            "resilience.checkpoint_every_steps=2", "tracking.charts_every_checkpoints=0",
            "tracking.loss_landscape=false"]
    config_file = str(ROOT / "configs" / "tiny-pretrained-cpu.yaml")
    whole = run_inprocess(tmp_path, config_file, sets + ["cluster.num_workers=4", "parallel.ep=4"], workers=4,
                          timeout_s=300.0)
    assert whole["status"] == "finished" and (whole["layout"]["dp"], whole["layout"]["ep"]) == (4, 4), whole

    step2, = tmp_path.glob("**/tiny-moe/checkpoint_step00000002")
    shutil.copytree(step2, step2.parent.parent / "tiny-moe-ep2" / step2.name)
    resized = run_inprocess(tmp_path, config_file, sets + ["name=tiny-moe-ep2", "cluster.num_workers=2",
                                                           "parallel.ep=2"], workers=2, timeout_s=300.0)
    assert resized["status"] == "finished" and (resized["layout"]["dp"], resized["layout"]["ep"]) == (2, 2), resized
    assert resized["layout"]["grad_accum"] == 2, resized["layout"]
    for key in ("train/loss", "moe/aux_loss"):
        got = dict(metric_history(tmp_path, resized["mlflow_run_id"], key))
        want = dict(metric_history(tmp_path, whole["mlflow_run_id"], key))
        assert sorted(got) == [3, 4], (key, got)
        assert [got[s] for s in (3, 4)] == pytest.approx([want[s] for s in (3, 4)], rel=1e-5, abs=1e-7), key
    # The resumed run moved the weights: its step-4 loss is not its step-3 loss.
    assert got[4] != pytest.approx(got[3], rel=1e-6)
