"""Chat fine-tuning of the 2026 families under Ray Train + DeepSpeed (2 CPU workers, ZeRO-2, jobs/train.py): a
Qwen3-style checkpoint (head_dim 32 over 4 heads, q/k norms, a template that drops earlier reasoning, so its
multi-turn chats become one document per assistant turn) and a Gemma-3-style one (local layers with an 8-token
window under document masking, (1 + w) norms, a system prompt folded into the first user turn), each with its own
tokenizer and chat template made here: the assistant-token loss falls, and the registered version answers in
transformers as that architecture, stopping at the turn's end (its generation_config's second stop id). And the Qwen3
one as a LoRA fine-tune."""

from __future__ import annotations

import importlib.util
import json

import pytest

from _cluster import ROOT, metric_history, run_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


chat_generate, chat_example = _load("chat_generate"), _load("make_tiny_chat_model")


def _chat_job(ray_head, tmp_path, arch, name, extra=()):
    """A chat fine-tune of a locally made `arch` checkpoint, 100 steps on 2 Ray workers: (made, job output,
    summary, registered model dir, its tokenizer dir), after asserting that it finished and its loss halved."""
    made = chat_example.save(str(tmp_path / "example"), 0, arch)
    config = str(ROOT / "configs" / "tiny-chat-finetune-cpu.yaml")
    r, summary = run_job(tmp_path, ["--config", config, "--set", f"model.pretrained={made['model']}",
                                    "--set", f"data.path={made['chats']}/*.jsonl", "--set", "train.max_steps=100",
                                    "--set", "train.eval_every_steps=0", "--set", f"name={name}", *extra],
                         ray_head.address, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert summary["status"] == "finished" and summary["world_size"] == 2 and summary["launcher"] == "ray"
    losses = metric_history(tmp_path, summary["mlflow_run_id"], "train/loss")
    (s0, first), (s1, last) = losses[0], losses[-1]
    print(f"\n{name}: assistant-token loss step {s0} {first:.4f} -> step {s1} {last:.4f}")
    assert last < 0.5 * first
    model_dir, tok_dir = chat_generate.model_dirs(f"models:/rayspeed-{name}/{summary['registered_model_version']}",
                                                  f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "dl"))
    return made, r.stdout + r.stderr, summary, model_dir, tok_dir


@pytest.mark.parametrize("arch,architecture", [("qwen3", "Qwen3ForCausalLM"), ("gemma3_text", "Gemma3ForCausalLM")])
def test_a_family_chat_finetune_learns_and_its_registered_version_answers(ray_head, tmp_path, arch, architecture):
    _, _, _, model_dir, tok_dir = _chat_job(ray_head, tmp_path, arch, f"chat-{arch}")
    config_json = json.loads(open(f"{model_dir}/config.json").read())
    generation = json.loads(open(f"{model_dir}/generation_config.json").read())
    assert config_json["architectures"] == [architecture] and len(generation["eos_token_id"]) == 2
    question = "What is the capital of Japan?"
    answer = chat_generate.answer(model_dir, question, 24, tok_dir)
    visible = answer.split("</think>")[-1].strip()  # Qwen3 answers after its (here empty) reasoning block
    print(f"{arch} registered version: Q: {question} A: {visible!r} (whole output {answer!r})")
    assert visible and "<|" not in answer and "<end_of_turn>" not in answer and len(visible.split()) >= 3


def test_a_lora_chat_finetune_learns_and_its_registered_version_answers(ray_head, tmp_path):
    """The same chat fine-tune with LoRA (rank 16, every linear layer; embedding and norms in full) on the frozen
    Qwen3-style base: the loss falls, the registered version (the merged model) answers in transformers, and the
    run's PEFT adapter on the base gives the merged model's logits."""
    import torch
    from mlflow.tracking import MlflowClient
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # The base's (tied) embedding and norms train in full: the chats' tokens are new to it (a random base: the
    # adapters alone plateau at 5.0 from 6.1).
    made, output, summary, model_dir, tok_dir = _chat_job(
        ray_head, tmp_path, "qwen3", "chat-lora", ["--set", "model.adapter.type=lora", "--set", "model.adapter.rank=16",
                                                   "--set", "model.adapter.trainable=[embed, norms]"])
    assert summary["layout"]["zero_stage"] == 2
    said = "adapters: LoRA rank 16 scale 2 on 14 layers (q,k,v,o,gate,up,down), embed+norms in full"
    assert said in output
    question = "What is the capital of Japan?"
    answer = chat_generate.answer(model_dir, question, 24, tok_dir)
    visible = answer.split("</think>")[-1].strip()
    print(f"LoRA registered version: Q: {question} A: {visible!r}")
    assert visible and "<|" not in answer and len(visible.split()) >= 3

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    adapter = MlflowClient(uri).download_artifacts(summary["mlflow_run_id"], "model/adapter", str(tmp_path / "ad"))
    base = AutoModelForCausalLM.from_pretrained(made["model"], dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, adapter).eval()
    merged = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(peft(ids).logits, merged(ids).logits, rtol=1e-5, atol=1e-5)
