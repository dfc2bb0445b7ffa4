"""A DeepSeek-V3 fine-tune through the real entry point on a real local Ray cluster: a locally made DeepSeek-V3
checkpoint in the published form (its projections float8_e4m3 with block scales, config.json naming the fp8
quantization) trained under Ray Train + DeepSpeed ZeRO-2 on 2 CPU workers with `parallel.ep: 2` and
`model.router_bias_update: 0.01` (the score corrections move by load after every step); the registered model loads
in transformers as a DeepseekV3ForCausalLM with the trained weights' logits, its corrections moved by whole steps
of 0.01, and `rayspeed export --format hf` of the last checkpoint (the experts gathered from both ranks' files,
the moved corrections saved in it) gives the same."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from _cluster import ROOT, run_job

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


def _published_form(tmp_path):
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(3)
    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        v_head_dim=12, qk_nope_head_dim=16, max_position_embeddings=128)
    d = tmp_path / "tiny-deepseek-v3"
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(d)
    tensors = load_file(str(d / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("proj.weight") or "proj_with_mqa" in n]:
        w = tensors[name]
        scale = w.abs().reshape(-1).max().clamp(min=1e-8) / 448.0  # one block: the whole (tiny) matrix
        tensors[name] = (w / scale).to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale.reshape(1, 1)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((d / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(hf))
    return d


def test_an_ep2_job_fine_tunes_the_fp8_form_and_exports_a_deepseek_v3(ray_head, tmp_path):
    import mlflow
    import transformers

    from rayspeed.compat import mlflow_process_store
    from rayspeed.model.export import load_model

    model_dir = _published_form(tmp_path)
    home = tmp_path / "home"
    r, s = run_job(home, ["--config", str(ROOT / "configs" / "tiny-pretrained-cpu.yaml"),
                          "--set", f"model.pretrained={model_dir}", "--set", "name=deepseek-ep2",
                          "--set", "model.seq_len=32", "--set", "train.global_batch_size=4",
                          "--set", "train.max_steps=4", "--set", "train.lr=1e-3", "--set", "parallel.ep=2",
                          "--set", "model.router_bias_update=0.01",
                          "--set", "resilience.checkpoint_every_steps=4", "--set", "tracking.loss_landscape=false",
                          "--set", "tracking.charts_every_checkpoints=0"], ray_head.address)
    assert r.returncode == 0 and s["status"] == "finished", r.stdout[-3000:] + r.stderr[-3000:]
    assert (s["layout"]["dp"], s["layout"]["ep"]) == (2, 2)

    exported = tmp_path / "export-hf"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "RAYSPEED_HOME": str(home),
           "PYTHONPATH": str(ROOT / "platform")}
    ckpt = home / "runs" / "deepseek-ep2" / "checkpoint_step00000004"
    e = subprocess.run([sys.executable, "-m", "rayspeed", "export", str(ckpt), str(exported), "--format", "hf"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert e.returncode == 0 and "wrote" in e.stdout, e.stderr[-2000:]
    with mlflow_process_store(f"sqlite:///{home / 'mlflow.db'}"):
        local = mlflow.artifacts.download_artifacts(
            f"models:/rayspeed-deepseek-ep2/{s['registered_model_version']}", dst_path=str(tmp_path / "dl"))

    trained = load_model(str(home / "runs" / "deepseek-ep2" / "model"))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained(ids)
        for folder in (f"{local}/model", exported):
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
            assert type(hf).__name__ == "DeepseekV3ForCausalLM" and "quantization_config" not in hf.config.to_dict()
            torch.testing.assert_close(hf(ids).logits, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{folder}: {m}")
            moved = torch.cat([b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")]) / 0.01
            assert moved.abs().max() > 0.5 and moved.abs().max() <= 4 + 1e-4  # four steps of +-0.01 (or none)
            torch.testing.assert_close(moved, moved.round(), rtol=0, atol=1e-4)
    from rayspeed.config.load import parse
    from rayspeed.config.shape import ModelShape
    from rayspeed.model.hf_weights import load_hf_weights
    from rayspeed.model.transformer import Transformer

    shape = ModelShape.from_config(parse({"model": {"seq_len": 32}}, [f"model.pretrained={model_dir}"]).model)
    base = Transformer(shape)
    load_hf_weights(base, str(model_dir), shape)
    with torch.no_grad():
        assert (base(ids) - want).abs().max() > 1e-4  # it trained
