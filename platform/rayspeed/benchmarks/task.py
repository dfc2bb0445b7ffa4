"""One evaluation, in a process of its own: a committed checkpoint (or a registered version, models:/name/3: its
logged model, what the retraining gates evaluate) exported to Hugging Face format (`rayspeed export ... --format
hf`, the command users run), then lm-evaluation-harness on it; the results go to <out>/results.json (written last,
atomically: its presence means done) and the exported model is deleted.

    python -m rayspeed.benchmarks.task '{"checkpoint": ..., "out": ..., "settings": {...}, "device": "cpu"}'
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

RESULTS = "results.json"


# What a training worker's environment says about its process group: an evaluation is a process of its own, and
# lm-eval (through accelerate) would join a group these describe.
DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                   "NODE_RANK", "CROSS_RANK", "CROSS_SIZE", "ACCELERATE_USE_DEEPSPEED")


def own_environment(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV and not k.startswith("TORCHELASTIC_")}
    return {**env, **extra}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Export, evaluate, write results.json; returns the results (or {"error": ...}, also written)."""
    env = own_environment(spec.get("env", {}))
    os.environ.clear()
    os.environ.update(env)
    out = spec["out"]
    os.makedirs(out, exist_ok=True)
    model_dir = os.path.join(out, "model")
    t0 = time.time()
    try:
        if os.path.isdir(model_dir):  # a retried task: start the export over
            shutil.rmtree(model_dir)
        # --byte-tokenizer: lm-eval needs tokenizer files, which a byte-level job's export otherwise leaves out.
        r = subprocess.run([sys.executable, "-m", "rayspeed", "export", spec["checkpoint"], model_dir, "--format",
                            "hf", "--byte-tokenizer"], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"export of {spec['checkpoint']} failed: {(r.stderr or r.stdout).strip()[-800:]}")
        exported = time.time()
        from rayspeed.benchmarks.harness import evaluate

        results = evaluate(model_dir, spec["settings"], spec.get("device", "cpu"))
        results.update(step=spec["step"], checkpoint=spec["checkpoint"], export_s=round(exported - t0, 2),
                       evaluate_s=round(time.time() - exported, 2))
    except Exception as e:  # the job logs why; an evaluation never fails a training run
        results = {"step": spec["step"], "checkpoint": spec["checkpoint"], "error": f"{type(e).__name__}: {e}"}
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    tmp = os.path.join(out, f".{RESULTS}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, os.path.join(out, RESULTS))
    return results


def main(argv: list[str]) -> int:
    results = run(json.loads(argv[0]))
    return 1 if "error" in results else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
