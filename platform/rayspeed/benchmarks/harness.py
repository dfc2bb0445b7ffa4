"""lm-evaluation-harness on one model directory, offline: tasks from task YAML files whose data is local, or
lm-eval's own tasks whose data is already in the local datasets cache.

lm-eval names a metric `<metric>,<filter>` ("acc,none", "exact_match,strict-match"); MLflow rejects commas, so a
score becomes `eval/<task>/<metric>` with the filter kept after an underscore when it is not `none`
("eval/gsm8k/exact_match_strict-match"); standard errors stay in the results JSON only."""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Optional

from rayspeed.config.eval_keys import task_file

_UNSAFE = re.compile(r"[^A-Za-z0-9_\-./ ]")
_PLAIN = re.compile(r"^[A-Za-z0-9_\-.]+$")


def all_local(settings: dict[str, Any]) -> bool:
    """Whether every task is a YAML file or found under include_path (then lm-eval's built-ins are not indexed)."""
    return all(os.path.isfile(t) or task_file(t, settings.get("include_path")) for t in settings["tasks"])


def task_manager(settings: dict[str, Any]) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=settings.get("include_path"), include_defaults=not all_local(settings))


def unknown_tasks(settings: dict[str, Any]) -> list[str]:
    """The task names neither a file, nor under include_path, nor among lm-eval's own tasks."""
    if all_local(settings):
        return []
    known = set(task_manager(settings).all_tasks)
    return [t for t in settings["tasks"] if not os.path.isfile(t) and t not in known]


def has_chat_template(model_dir: str) -> bool:
    if os.path.isfile(os.path.join(model_dir, "chat_template.jinja")):
        return True
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return False


def evaluate(model_dir: str, settings: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    """lm-eval's results for the model in `model_dir` (what of them is JSON: scores, directions, shots, counts)."""
    from lm_eval import simple_evaluate

    chat = settings.get("chat_template", "auto")
    use_chat = has_chat_template(model_dir) if chat == "auto" else bool(chat)
    res = simple_evaluate(model="hf", model_args={"pretrained": model_dir, "dtype": "float32" if device == "cpu"
                                                  else "auto"},
                          tasks=list(settings["tasks"]), num_fewshot=settings.get("num_fewshot"),
                          limit=settings.get("limit"), batch_size=int(settings.get("batch_size", 8)), device=device,
                          log_samples=False, bootstrap_iters=0, apply_chat_template=use_chat,
                          task_manager=task_manager(settings))
    if res is None:  # not rank 0 of lm-eval's own distributed run: never the case here
        raise RuntimeError("lm-eval returned no results")
    keep = ("results", "higher_is_better", "n-shot", "n-samples", "versions", "group_subtasks")
    return json.loads(json.dumps({k: res.get(k) for k in keep}, default=str)) | {"chat_template": use_chat}


def _label(metric: str, filt: str) -> str:
    return metric if filt in ("", "none") else f"{metric}_{filt}"


def metric_key(task: str, name: str) -> Optional[str]:
    """`eval/<task>/<metric>` for a score of lm-eval's results (None: a standard error or not a score)."""
    metric, _, filt = name.partition(",")
    if "_stderr" in metric or metric in ("alias", "name", "sample_len", "samples"):
        return None
    return _UNSAFE.sub("_", f"eval/{task}/{_label(metric, filt)}")


def metric_labels(task: str, settings: dict[str, Any], manager: Any = None) -> Optional[list[str]]:
    """The `<metric>` part of every eval/<task>/<metric> an evaluation of `task` will report, read from the task's
    config before anything runs: its metric_list (lm-eval's defaults for its output_type without one) x its
    filter_list (`none` without one), or a group's aggregate_metric_list x filter_list. None where the config alone
    does not say: a Python task, process_results without a metric_list, a metric given as a function, a group
    whose filters lm-eval finds in its children's results, a tag (its tasks report under their own names).
    manager: task_manager(settings), when the caller has one (indexing lm-eval's own tasks takes seconds)."""
    from lm_eval.api.registry import DEFAULT_METRIC_REGISTRY

    # The index holds each task's YAML as read (includes merged, !function values left as their paths).
    entry = (manager or task_manager(settings)).task_index.get(task)
    kind = getattr(getattr(entry, "kind", None), "name", None)
    cfg = getattr(entry, "cfg", None)
    if kind not in ("TASK", "GROUP") or not isinstance(cfg, dict):
        return None
    pairs: list[tuple[Any, Any]] = []
    if kind == "GROUP":
        aggregates = cfg.get("aggregate_metric_list") or []
        for agg in aggregates if isinstance(aggregates, list) else [aggregates]:
            filters = agg.get("filter_list") if isinstance(agg, dict) else None
            if filters is None:
                return None
            pairs += [(agg.get("metric"), f) for f in ([filters] if isinstance(filters, str) else filters)]
    else:
        if cfg.get("process_results") and not cfg.get("metric_list"):
            return None
        metrics = [m.get("metric") if isinstance(m, dict) else None for m in cfg.get("metric_list") or []] or \
            DEFAULT_METRIC_REGISTRY.get(cfg.get("output_type") or "generate_until", [])
        filters = [f.get("name") if isinstance(f, dict) else None for f in cfg.get("filter_list") or []] or ["none"]
        pairs = [(m, f) for m in metrics for f in filters]
    if not pairs or not all(isinstance(x, str) and _PLAIN.match(x) for pair in pairs for x in pair):
        return None  # a !function metric: its name is the function's, known once it is imported
    return sorted({_UNSAFE.sub("_", _label(m, f)) for m, f in pairs})


def metrics_of(results: dict[str, Any]) -> dict[str, float]:
    out = {}
    for task, scores in (results.get("results") or {}).items():
        for name, value in scores.items():
            key = metric_key(task, name)
            if key is not None and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                out[key] = float(value)
    return out


def higher_is_better(results: dict[str, Any], task: str, label: str) -> bool:
    """lm-eval's direction for the score `eval/<task>/<label>` (True when lm-eval does not say)."""
    want = _UNSAFE.sub("_", f"eval/{task}/{label}")
    directions = (results.get("higher_is_better") or {}).get(task, {})
    for name in (results.get("results") or {}).get(task, {}):
        if metric_key(task, name) == want:
            return bool(directions.get(name.partition(",")[0], True))
    return True
