"""Make the reinforcement-learning example, locally (nothing is downloaded): a small Llama briefly fine-tuned to
answer "What is a plus b? " for single digits, so that it knows the form of an answer but gets about half of the
sums wrong, and the 100 prompts with their answers.

    make examples                                       # runs this with the default OUT
    python scripts/make_tiny_sum_model.py [OUT]         # default runs/examples/tiny-sum in the repository
    make train CONFIG=configs/tiny-grpo-cpu.yaml        # GRPO on the prompts with an exact-answer reward
    python scripts/make_tiny_sum_model.py --score DIR   # greedy accuracy of a model folder over the 100 sums

OUT/model/          LlamaForCausalLM (hidden 64, 2 layers, tied embeddings) with a byte-level tokenizer whose end
                    token is byte 0, fine-tuned with AdamW for STEPS steps of 32 answers "What is a plus b? c" + end
                    (the loss on the answer only), saved with save_pretrained.
OUT/prompts/sums.jsonl  {"prompt": "What is a plus b? ", "answer": a + b} for a, b in 0..9 (TRL's prompt-only form,
                    the answer a column the reward function reads).

Re-running with the same OUT rewrites the same files (fixed seed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "runs", "examples", "tiny-sum")
STEPS, LR, BATCH = 80, 3e-3, 32
SHAPE = dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, tied=True, rope="default", max_positions=64)


def prompt(a: int, b: int) -> str:
    return f"What is {a} plus {b}? "


def records() -> list[dict[str, Any]]:
    return [{"prompt": prompt(a, b), "answer": a + b} for a in range(10) for b in range(10)]


def accuracy(model: Any, tokenizer: Any) -> float:
    """Greedy answers (3 new tokens at most, stopping at the end token) whose last number is the sum."""
    import torch

    right = 0
    model.eval()
    with torch.no_grad():
        for a in range(10):
            ids = torch.tensor([tokenizer(text=prompt(a, b))["input_ids"] for b in range(10)])  # equal lengths
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                                 eos_token_id=0, pad_token_id=0)
            for b in range(10):
                numbers = re.findall(r"-?\d+", tokenizer.decode(out[b, ids.shape[1]:], skip_special_tokens=True))
                right += bool(numbers) and int(numbers[-1]) == a + b
    return right / 100


def score(model_dir: str) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return accuracy(AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir))


def finetune(model: Any, tokenizer: Any, seed: int, steps: int = STEPS) -> None:
    import torch
    import torch.nn.functional as F

    rows, starts = [], []
    for r in records():
        p = tokenizer(text=r["prompt"])["input_ids"]
        rows.append(p + tokenizer(text=str(r["answer"]))["input_ids"] + [0])
        starts.append(len(p))
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, (row, s) in enumerate(zip(rows, starts)):
        ids[i, :len(row)] = torch.tensor(row)
        labels[i, s:len(row)] = torch.tensor(row[s:])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    order = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        pick = torch.randperm(len(rows), generator=order)[:BATCH]
        logits = model(ids[pick]).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[pick, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def save(out: str, seed: int = 0, steps: int = STEPS) -> dict[str, Any]:
    """steps: 0 leaves the model untrained (the same files, for checks that read only the shape)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import make_tiny_hf_model as tiny

    model_dir = os.path.join(out, "model")
    tiny.save(model_dir, "llama", seed=seed, tokenizer=True, **SHAPE)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    finetune(model, tokenizer, seed, steps)
    model.generation_config.eos_token_id = 0
    model.save_pretrained(model_dir)
    prompts = os.path.join(out, "prompts")
    os.makedirs(prompts, exist_ok=True)
    with open(os.path.join(prompts, "sums.jsonl"), "w") as f:
        for r in records():
            f.write(json.dumps(r) + "\n")
    return {"model": model_dir, "prompts": prompts, "accuracy": accuracy(model, tokenizer)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--score", metavar="DIR", help="print the greedy accuracy of the model folder DIR and exit")
    a = ap.parse_args(argv)
    if a.score:
        print(f"greedy accuracy over the 100 sums: {score(a.score):.2f}")
        return 0
    made = save(a.out, a.seed)
    print(f"model and tokenizer: {made['model']} (greedy accuracy over the 100 sums: {made['accuracy']:.2f})")
    print(f"100 prompts with their answers in {made['prompts']}/sums.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
