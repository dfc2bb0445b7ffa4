"""An adapter job end to end with --launcher local (jobs/train.py in a subprocess, DeepSpeed ZeRO-2, a real MLflow
store): with async checkpoints, killed inside its step-6 save and resubmitted, it resumes its step-3 checkpoint and
continues the uninterrupted run's loss curve to 1e-5 (adapter dropout 0.1: the masks are restored with the RNG); its
checkpoints hold the adapter only; its exported model is the merged one, with the PEFT adapter beside it that peft
loads on the base to the same logits; and a resubmission on other base weights (same directory, new files) is exit 2
naming both."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from _cluster import metric_history, run_job
from _hf_models import LLAMA_TIED, save

pytestmark = pytest.mark.timeout(600)

SETTINGS = ["--launcher", "local", "--set", "name=lora-job", "--set", "model.adapter.type=lora",
            "--set", "model.adapter.rank=4", "--set", "model.adapter.dropout=0.1", "--set", "model.seq_len=32",
            "--set", "train.global_batch_size=4", "--set", "train.max_steps=6", "--set", "train.lr=1e-3",
            "--set", "resilience.checkpoint_every_steps=3", "--set", "tracking.log_every_steps=1"]


def _args(base):
    return ["--config", "configs/tiny-pretrained-cpu.yaml", "--set", f"model.pretrained={base}", *SETTINGS]


def _losses(home, summary):
    per_step = dict(metric_history(home, summary["mlflow_run_id"], "train/loss"))  # the last value of each step
    return [per_step[s] for s in sorted(per_step)]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("base") / "llama"
    save(d, LLAMA_TIED, seed=11, tokenizer=True)
    return d


def test_killed_adapter_job_resumes_to_the_same_loss_curve_and_exports_a_peft_adapter(tmp_path, base):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    r, s = run_job(whole, _args(base), None)
    assert r.returncode == 0 and s["steps"] == 6, r.stderr[-3000:]
    assert "adapters: LoRA rank 4 scale 8 on 14 layers" in r.stderr

    # Async checkpoints, and the rank killed inside the step-6 save (in the background writer, its shards written,
    # before the manifest): the restart resumes the async-written step-3 checkpoint and replays 4-6.
    drill = [*_args(base), "--set", "resilience.checkpoint_mode=async",
             "--set", "chaos.kill_rank_in_checkpoint={rank: 0, step: 6, point: before_manifest}"]
    r, _ = run_job(killed, drill, None)
    assert r.returncode != 0 and "inside the checkpoint write of step 6 (before_manifest)" in r.stderr, r.stderr[-3000:]
    assert "checkpoints: resilience.checkpoint_mode async -> async" in r.stderr
    r, s2 = run_job(killed, drill, None)
    assert r.returncode == 0 and s2["steps"] == 6, r.stderr[-3000:]
    assert "resumed from checkpoint_step00000003 at step 3" in r.stderr
    assert s2["checkpoint_bytes"] > 0
    want, got = _losses(whole, s), _losses(killed, s2)
    assert len(want) == len(got) == 6
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-5)

    # The checkpoint: the adapter's tensors only (the base is model.pretrained's, reloaded at build).
    states = torch.load(whole / "runs" / "lora-job" / "checkpoint_step00000006" / "ds" / "mp_rank_00_model_states.pt",
                        weights_only=False)
    assert states["module"] and all(".adapter.lora_" in k for k in states["module"])

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rayspeed.model.export import load_model

    # The job's export: the merged model, its adapter beside it; `rayspeed export` of the last checkpoint in both
    # formats, the run's adapter by run id. The merged (W + s B A) x and the unmerged W x + s B (A x) round
    # differently in fp32, on this model by less than 1e-5.
    model_dir = whole / "runs" / "lora-job" / "model"
    ckpt = whole / "runs" / "lora-job" / "checkpoint_step00000006"
    out = {}
    for fmt, src in (("peft", str(ckpt)), ("hf", str(ckpt)), ("peft-run", s["mlflow_run_id"])):
        out[fmt] = tmp_path / f"export-{fmt}"
        r = _cli("export", src, str(out[fmt]), "--format", fmt.split("-")[0], "--tracking-uri",
                 f"sqlite:///{whole / 'mlflow.db'}", home=whole)
        assert r.returncode == 0 and "wrote" in r.stdout, r.stderr[-2000:]
    merged = load_model(str(model_dir))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = merged(ids)
        for folder in (model_dir / "adapter", out["peft"], out["peft-run"]):
            peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                                             str(folder)).eval()
            torch.testing.assert_close(peft(ids).logits, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{folder}: {m}")
        hf = AutoModelForCausalLM.from_pretrained(str(out["hf"]), dtype=torch.float32).eval()
        torch.testing.assert_close(hf(ids).logits, want, rtol=1e-5, atol=1e-5)  # both merged the same way
        plain = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)(ids).logits
    assert (plain - want).abs().max() > 1e-3  # the adapter trained: the merged model is not the base

    # A new adapter warm-started from that merged model: its PEFT base is the model it trained on, and its
    # checkpoint cannot be merged into model.pretrained's weights (exit 2 saying where to export from).
    warm = tmp_path / "warm"
    r, s3 = run_job(warm, [*_args(base), "--set", "name=lora-warm", "--set", "train.max_steps=3",
                           "--set", f"train.init_from={model_dir}"], None)
    assert r.returncode == 0 and s3["steps"] == 3, r.stderr[-3000:]
    ckpt = warm / "runs" / "lora-warm" / "checkpoint_step00000003"
    r = _cli("export", str(ckpt), str(tmp_path / "warm-peft"), "--format", "peft", home=warm)
    assert r.returncode == 0, r.stderr[-2000:]
    config = json.loads((tmp_path / "warm-peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(model_dir)
    r = _cli("export", str(ckpt), str(tmp_path / "warm-hf"), "--format", "hf", home=warm)
    assert r.returncode == 2 and "trained on train.init_from" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "warm-hf").exists()


def _cli(*args, home):
    import subprocess
    import sys

    from _cluster import ROOT

    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "RAYSPEED_HOME": str(home), "PYTHONPATH": str(ROOT / "platform")}
    return subprocess.run([sys.executable, "-m", "rayspeed", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_resuming_on_other_base_weights_is_refused_naming_both(tmp_path, base):
    own = tmp_path / "llama"
    shutil.copytree(base, own)
    args = [*_args(own), "--set", "train.max_steps=3"]
    r, s = run_job(tmp_path, args, None)
    assert r.returncode == 0 and s["steps"] == 3, r.stderr[-3000:]
    save(tmp_path / "other", LLAMA_TIED, seed=12, tokenizer=True)
    shutil.copy(tmp_path / "other" / "model.safetensors", own / "model.safetensors")
    r, s = run_job(tmp_path, args, None)
    assert r.returncode == 2 and s is None
    err = r.stderr.strip().splitlines()[-1]
    assert "model.pretrained (weights): 'sha256:" in err and "' -> 'sha256:" in err, err
    assert "Traceback" not in r.stderr


def test_a_qlora_job_trains_on_4bit_weights_and_merges_into_the_original_ones(tmp_path, base):
    """base_precision nf4: the job trains against NF4 weights, its export and `rayspeed export --format hf` merge
    the adapter into model.pretrained's own fp32 weights (W + s B A), not into the dequantized ones."""
    from safetensors.torch import load_file

    from rayspeed.model.export import load_model

    pytest.importorskip("bitsandbytes")
    r, s = run_job(tmp_path, [*_args(base), "--set", "name=qlora-job", "--set", "model.adapter.base_precision=nf4",
                              "--set", "train.max_steps=4", "--set", "resilience.checkpoint_every_steps=4"], None)
    assert r.returncode == 0 and s["steps"] == 4, r.stderr[-3000:]
    assert "14 base linear layers in NF4 (double quant)" in r.stderr
    losses = _losses(tmp_path, s)
    assert len(losses) == 4 and losses[-1] < losses[0]
    model_dir = tmp_path / "runs" / "qlora-job" / "model"
    adapter = load_file(str(model_dir / "adapter" / "adapter_model.safetensors"))
    original = load_file(str(base / "model.safetensors"))
    merged = torch.load(model_dir / "weights.pt", weights_only=True)
    for hf_name, ours in (("model.layers.0.self_attn.q_proj", "layers.0.attn.wq"),
                          ("model.layers.1.mlp.down_proj", "layers.1.mlp.w_down")):
        peft = f"base_model.model.{hf_name}"
        want = original[f"{hf_name}.weight"] + 8.0 * adapter[f"{peft}.lora_B.weight"] @ adapter[f"{peft}.lora_A.weight"]
        torch.testing.assert_close(merged[f"{ours}.weight"], want, rtol=1e-6, atol=1e-6)
    assert (adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]).abs().max() > 0

    out = tmp_path / "export-hf"
    r = _cli("export", str(tmp_path / "runs" / "qlora-job" / "checkpoint_step00000004"), str(out), "--format", "hf",
             home=tmp_path)
    assert r.returncode == 0 and "wrote" in r.stdout, r.stderr[-2000:]
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        torch.testing.assert_close(hf(ids).logits, load_model(str(model_dir))(ids), rtol=1e-5, atol=1e-5)


def test_a_peft_adapter_made_elsewhere_continues_on_its_base(tmp_path, base):
    """train.init_from a PEFT folder (as TRL or Axolotl leave one): the job loads model.pretrained and the adapter's
    tensors, trains on, and exports an adapter whose base is model.pretrained; a job whose adapter settings differ
    from the folder's is exit 2 naming the key and both values, before anything is written."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rayspeed.adapters import peft_files
    from rayspeed.config.load import parse
    from rayspeed.config.schema import AdapterConfig
    from rayspeed.config.shape import ModelShape

    shape = ModelShape.from_config(parse({"model": {"pretrained": str(base)}}).model)
    made = tmp_path / "made-elsewhere"
    torch.manual_seed(5)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32), LoraConfig(
        r=4, lora_alpha=32, init_lora_weights=False,
        target_modules=peft_files.target_modules(AdapterConfig(type="lora"), shape)))
    peft.save_pretrained(str(made))
    args = [*_args(base), "--set", "name=lora-continued", "--set", "train.max_steps=2", "--set",
            "resilience.checkpoint_every_steps=2", "--set", f"train.init_from={made}"]
    r, _ = run_job(tmp_path / "wrong", [*args, "--set", "model.adapter.rank=8"], None)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "model.adapter.rank: 8 here, 4 in train.init_from" in r.stderr
    assert not (tmp_path / "wrong" / "runs").exists()

    r, s = run_job(tmp_path / "home", args, None)
    assert r.returncode == 0 and s["steps"] == 2, r.stderr[-3000:]
    assert f"adapter warm start from the PEFT adapter {made}: 28 tensors" in r.stderr
    out = tmp_path / "home" / "runs" / "lora-continued" / "model" / "adapter"
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base)
    start, end = load_file(str(made / "adapter_model.safetensors")), load_file(str(out / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    delta = (end[key] - start[key]).abs().max()
    assert 0 < delta < 0.1 * start[key].abs().max()  # trained on from the adapter, not from B = 0
