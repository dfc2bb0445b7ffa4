"""A Mixtral job through the worker path (tests/_inprocess.py: two gloo workers, dp2, ZeRO-2, experts replicated):
model.pretrained names a locally made MixtralForCausalLM; train/loss is the language-model loss alone (transformers'
cross entropy on step 1's batch, without the balance term that trains beside it); moe/aux_loss and
moe/load_imbalance at step 1 are transformers' (its aux_loss per forward, averaged; its routing's tokens per expert
over the whole global batch), moe/expert_load/ holds every routed token; the registered version loads in
transformers as a MixtralForCausalLM. The same job at pp2 (one MoE layer per stage) logs the same step-1 language
loss and routing metrics (each stage's layers' load, the balance loss the last stage pools) and registers a Mixtral
with every tensor of the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


def _mixtral(tmp_path):
    import transformers

    torch.manual_seed(5)
    config = transformers.MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.05)
    model_dir = tmp_path / "tiny-mixtral"
    transformers.MixtralForCausalLM(config).save_pretrained(model_dir)
    return model_dir


def _job(tmp_path, model_dir, pp, zero, *extra):
    from _cluster import ROOT
    from _inprocess import run_inprocess

    sets = [f"model.pretrained={model_dir}", "name=tiny-mixtral", "train.max_steps=2", "tracking.log_every_steps=1",
            "cluster.num_workers=2", "parallel.tp=1", f"parallel.pp={pp}", f"parallel.zero_stage={zero}",
            "tracking.charts_every_checkpoints=0", "tracking.loss_landscape=false",
            "resilience.checkpoint_every_steps=0", *extra]
    summary = run_inprocess(tmp_path, str(ROOT / "configs" / "tiny-pretrained-cpu.yaml"), sets, workers=2)
    assert summary["status"] == "finished" and summary["layout"]["dp"] == 2 // pp, summary
    return summary


def _check_routing_metrics(tmp_path, model_dir, summary, windows):
    """moe/aux_loss, moe/load_imbalance and moe/dropped_tokens at step 1 are transformers' on the global batch, in the
    job's micro-batches; moe/expert_load/ holds every routed token of both steps."""
    import mlflow
    import transformers

    from _cluster import metric_history
    from rayspeed.compat import mlflow_process_store

    # Rank r's forward j takes rows (j * dp + r) * b onward: every forward is one b-row chunk of the global batch.
    run_id = summary["mlflow_run_id"]
    hf = transformers.MixtralForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    b = summary["layout"]["micro_batch_size"]
    with torch.no_grad():
        chunks = [hf(windows[i:i + b, :-1], output_router_logits=True) for i in range(0, 8, b)]
    aux = sum(float(o.aux_loss) for o in chunks) / len(chunks)
    counts = torch.stack([sum(torch.bincount(torch.topk(o.router_logits[layer], 2).indices.reshape(-1), minlength=4)
                              for o in chunks) for layer in range(2)]).double()
    imbalance = (counts.max(1).values / counts.mean(1)).max().item()
    for key, want in (("moe/aux_loss", aux), ("moe/load_imbalance", imbalance), ("moe/dropped_tokens", 0.0)):
        (step, got), *_ = metric_history(tmp_path, run_id, key)
        assert step == 1 and got == pytest.approx(want, rel=1e-5, abs=1e-7), key

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with mlflow_process_store(f"sqlite:///{tmp_path / 'mlflow.db'}"):
        names = sorted(a.path for a in client.list_artifacts(run_id, "moe/expert_load"))
        assert names == ["moe/expert_load/step_0000002.json", "moe/expert_load/step_0000002.png"], names
        load = json.loads(mlflow.artifacts.load_text(f"runs:/{run_id}/moe/expert_load/step_0000002.json"))
    assert load["steps"] == [1, 2] and load["layers"] == [0, 1]
    assert [sum(row) for row in load["tokens_per_expert"]] == [2 * 8 * 128 * 2] * 2  # steps x rows x tokens x k


def test_a_mixtral_job_logs_the_language_loss_and_registers_a_mixtral(tmp_path):
    import mlflow
    from transformers import AutoModelForCausalLM

    from _cluster import metric_history
    from _hf_models import first_batch_loss
    from rayspeed.compat import mlflow_process_store

    model_dir = _mixtral(tmp_path)
    summary = _job(tmp_path, model_dir, 1, 2)

    expected, windows = first_batch_loss(tmp_path, model_dir, 128, 8, 1234)
    run_id = summary["mlflow_run_id"]
    (step, first), *_ = metric_history(tmp_path, run_id, "train/loss")
    assert step == 1 and first == pytest.approx(expected, rel=1e-5)

    _check_routing_metrics(tmp_path, model_dir, summary, windows)

    with mlflow_process_store(f"sqlite:///{tmp_path / 'mlflow.db'}"):
        local = mlflow.artifacts.download_artifacts(
            f"models:/rayspeed-tiny-mixtral/{summary['registered_model_version']}", dst_path=str(tmp_path / "dl"))
    registered = AutoModelForCausalLM.from_pretrained(f"{local}/model", dtype=torch.float32)
    assert type(registered).__name__ == "MixtralForCausalLM" and registered.config.num_local_experts == 4


def test_a_pp2_mixtral_job_logs_the_language_loss_and_registers_every_tensor(tmp_path):
    import mlflow
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from _cluster import metric_history
    from _hf_models import first_batch_loss
    from rayspeed.compat import mlflow_process_store

    model_dir = _mixtral(tmp_path)
    summary = _job(tmp_path, model_dir, 2, 1)
    assert summary["layout"]["pp"] == 2, summary
    expected, windows = first_batch_loss(tmp_path, model_dir, 128, 8, 1234)
    (step, first), *_ = metric_history(tmp_path, summary["mlflow_run_id"], "train/loss")
    assert step == 1 and first == pytest.approx(expected, rel=1e-5)
    _check_routing_metrics(tmp_path, model_dir, summary, windows)  # each stage's layers, pooled by the last
    with mlflow_process_store(f"sqlite:///{tmp_path / 'mlflow.db'}"):
        local = mlflow.artifacts.download_artifacts(
            f"models:/rayspeed-tiny-mixtral/{summary['registered_model_version']}", dst_path=str(tmp_path / "dl"))
    registered = AutoModelForCausalLM.from_pretrained(f"{local}/model", dtype=torch.float32)
    assert type(registered).__name__ == "MixtralForCausalLM"
    original = load_file(str(model_dir / "model.safetensors"))
    exported: dict = {}
    for part in (Path(local) / "model").glob("*.safetensors"):  # the files as written: per-expert hub names
        exported.update(load_file(str(part)))
    assert set(exported) == set(original) and any(".experts.3." in k for k in original)
    assert all(exported[k].shape == v.shape for k, v in original.items())
    router = "model.layers.0.block_sparse_moe.gate.weight"  # trained on the first stage by the last stage's term
    assert not torch.equal(exported[router], original[router])


def test_a_lora_job_on_experts_split_over_ep2_registers_an_adapter_peft_applies_to_the_base(tmp_path):
    """LoRA (the attention) on a Mixtral whose frozen experts are split over ep 2 (dp2, ZeRO-2): the registered
    model is the merged one, and peft applies the run's adapter to the original checkpoint to its logits."""
    import mlflow
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from _cluster import metric_history
    from rayspeed.compat import mlflow_process_store

    model_dir = _mixtral(tmp_path)
    summary = _job(tmp_path, model_dir, 1, 2, "parallel.ep=2", "model.adapter.type=lora", "model.adapter.rank=4",
                   "train.max_steps=4", "train.lr=5.0e-3", "train.warmup_steps=0")
    assert summary["layout"]["ep"] == 2, summary["layout"]
    losses = [v for _, v in metric_history(tmp_path, summary["mlflow_run_id"], "train/loss")]
    assert len(losses) == 4 and all(v == v for v in losses) and losses[-1] < losses[0], losses
    with mlflow_process_store(f"sqlite:///{tmp_path / 'mlflow.db'}"):
        local = Path(mlflow.artifacts.download_artifacts(
            f"models:/rayspeed-tiny-mixtral/{summary['registered_model_version']}", dst_path=str(tmp_path / "dl")))
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(str(local / "model"), dtype=torch.float32).eval()(ids).logits
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        before = base(ids).logits
        on_base = PeftModel.from_pretrained(base, str(local / "rayspeed" / "adapter")).eval()(ids).logits
    assert (merged - before).abs().max() > 1e-3  # the adapter trained
    torch.testing.assert_close(on_base, merged, rtol=1e-5, atol=1e-5)
