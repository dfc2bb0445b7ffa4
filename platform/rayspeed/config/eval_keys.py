"""The `eval` section: benchmark evaluation with lm-evaluation-harness on committed checkpoints, beside training.

Validation loss stays where it was (train.eval_every_steps, train.eval_batches: the held-out split, in the
training loop, every N steps); `eval.harness` is the other kind of evaluation: task scores of the model a
checkpoint holds, run outside the loop on the checkpoint's files. Torch-free: the job checks read it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union


@dataclass
class HarnessConfig:
    tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks: names of task YAML files under include_path, or lm-eval's own task names
    (their data must already be in the local datasets cache: nothing is downloaded during training). Empty: off."""
    include_path: Optional[str] = None
    """A folder of task YAML files (relative: to the launch home). With every task found there, lm-eval's built-in
    tasks are not indexed (TaskManager(include_defaults=False): faster, and no task of the same name shadows
    yours)."""
    limit: Optional[int] = None
    """Examples per task (None: all): a quick score during training, the full task at the end."""
    num_fewshot: Optional[int] = None
    """Few-shot examples per prompt (None: each task's own default)."""
    chat_template: Union[bool, Literal["auto"]] = "auto"
    """Render prompts with the tokenizer's chat template (instruct models). auto: when the tokenizer has one."""
    every_checkpoints: int = 1
    """Evaluate every N committed checkpoints (the final model is always evaluated); 0: only the final model."""
    batch_size: int = 8
    """lm-eval's batch size."""
    resources: dict[str, float] = field(default_factory=dict)
    """Ray resources of the evaluation task. Empty: {GPU: 1} on GPU clusters; no CPU on a CPU cluster, so it never
    waits for training's CPUs nor takes them (under --launcher local it is a background process)."""
    timeout_s: float = 1800.0
    """How long the end of a job waits for evaluations still running before it closes the run without them."""


@dataclass
class EvalConfig:
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    """lm-evaluation-harness tasks on committed checkpoints (README "Benchmarks during training")."""


def enabled(cfg: Any) -> bool:
    return bool(getattr(getattr(cfg, "eval", None), "harness", None) and cfg.eval.harness.tasks)


def task_file(name: str, include_path: Optional[str]) -> Optional[str]:
    """The YAML file of a task named in include_path (its `task:` key or its file name), or None."""
    if not include_path or not os.path.isdir(include_path):
        return None
    for root, _, files in os.walk(include_path):
        for f in sorted(files):
            if not f.endswith((".yaml", ".yml")):
                continue
            path = os.path.join(root, f)
            if os.path.splitext(f)[0] == name or _declares(path, name):
                return path
    return None


def _declares(path: str, name: str) -> bool:
    try:
        with open(path, encoding="utf-8") as fh:
            return any(line.strip() in (f"task: {name}", f'task: "{name}"', f"task: '{name}'") for line in fh)
    except OSError:
        return False


def problems(cfg: Any) -> list[str]:
    h = cfg.eval.harness
    p: list[str] = []
    if not h.tasks:
        return p
    if h.limit is not None and h.limit < 1:
        p.append(f"eval.harness.limit: must be >= 1 (or null: every example), got {h.limit}")
    if h.num_fewshot is not None and h.num_fewshot < 0:
        p.append(f"eval.harness.num_fewshot: must be >= 0 (or null: the task's default), got {h.num_fewshot}")
    if h.every_checkpoints < 0:
        p.append(f"eval.harness.every_checkpoints: must be >= 0 (0: only the final model), got {h.every_checkpoints}")
    if h.batch_size < 1:
        p.append(f"eval.harness.batch_size: must be >= 1, got {h.batch_size}")
    if h.include_path is not None and not os.path.isdir(h.include_path):
        p.append(f"eval.harness.include_path: {h.include_path} is not a folder (of lm-eval task YAML files)")
    if h.every_checkpoints and not cfg.resilience.checkpoint_every_steps:
        p.append("eval.harness.every_checkpoints: the job saves no checkpoints (resilience.checkpoint_every_steps 0); "
                 "set it, or eval.harness.every_checkpoints: 0 to evaluate the final model only")
    bad = [k for k, v in h.resources.items() if not isinstance(v, (int, float)) or v < 0]
    if bad:
        p.append(f"eval.harness.resources: {bad} must be numbers >= 0 (Ray resources, e.g. {{GPU: 1}})")
    return p
