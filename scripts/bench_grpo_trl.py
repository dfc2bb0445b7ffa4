"""TRL 1.16's GRPOTrainer on the GRPO example's model and prompts (scripts/make_tiny_sum_model.py) with the settings
of configs/tiny-grpo-cpu.yaml, one process on the CPU (use_cpu, no vLLM): the time of every step, its completions'
mean length, and the steady-state steps/s and generated tokens/s after --skip steps. One JSON line; scripts/bench.py's
`grpo` line sets it beside rayspeed's.

    PYTHONPATH=platform python scripts/bench_grpo_trl.py --model DIR --prompts FILE [--steps 30] [--skip 5]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--out", default="/tmp/bench-grpo-trl")
    a = ap.parse_args()
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rayspeed.objectives.reward_examples import exact_number

    t = yaml.safe_load((ROOT / "configs" / "tiny-grpo-cpu.yaml").read_text())["train"]
    g = t["grpo"]
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    tokenizer = AutoTokenizer.from_pretrained(a.model)
    tokenizer.pad_token = tokenizer.eos_token
    args = GRPOConfig(output_dir=a.out, use_cpu=True, report_to=[], save_strategy="no", bf16=False,
                      per_device_train_batch_size=t["global_batch_size"], num_generations=g["num_generations"],
                      max_completion_length=g["max_new_tokens"], temperature=g["temperature"], beta=g["beta"],
                      loss_type=g["loss"], learning_rate=t["lr"], lr_scheduler_type="constant",
                      weight_decay=t["weight_decay"], adam_beta2=t["adam_beta2"], max_grad_norm=t["grad_clip"],
                      max_steps=a.steps, seed=t["seed"], logging_steps=1, disable_tqdm=True)
    records = [json.loads(line) for line in Path(a.prompts).read_text().splitlines() if line.strip()]
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(a.model), reward_funcs=[exact_number], args=args,
                          train_dataset=Dataset.from_list(records), processing_class=tokenizer, callbacks=[Clock()])
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    steady = ends[a.skip - 1:]
    seconds = steady[-1] - steady[0]
    tokens = sum(lengths[a.skip:]) * t["global_batch_size"]
    print(json.dumps({"bench": "grpo_trl", "steps": a.steps, "skip": a.skip, "wall_s": round(wall, 3),
                      "steps_per_s": round((len(steady) - 1) / seconds, 3),
                      "generated_tokens_per_s": round(tokens / seconds, 1),
                      "torch_threads": __import__("torch").get_num_threads()}))


if __name__ == "__main__":
    main()
