"""`rayspeed retrain --gate <task>/<metric>[:min_delta]`: promotion on benchmark scores, measured the same way on
the champion and the challenger (both registered versions scored now with the job's eval.harness settings: the
same tasks, examples, shots and chat template), not on recorded values.

A gate holds when the challenger's score is at least the champion's plus min_delta in the metric's own direction
(lm-eval's higher_is_better for it): new >= champion + min_delta when higher is better, new <= champion - min_delta
when lower is. min_delta is absolute, in the metric's units, 0 by default (no worse); a negative one tolerates a
drop of that much. With gates, the gates decide alone: val/loss is still measured and recorded, and --margin is
not applied (promote on val/loss by giving no gate). With no champion the first version is promoted, as without
gates. A metric its task's config does not report (lm-eval's metric_list x filter_list) is bad input before anything
trains; a gate whose score an evaluation still does not produce (a task that failed) rejects, naming it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

_GATE = re.compile(r"^(?P<task>[^/:]+)/(?P<metric>[^:]+)(?::(?P<delta>.*))?$")


@dataclass(frozen=True)
class Gate:
    task: str
    metric: str
    min_delta: float = 0.0

    @property
    def key(self) -> str:
        return f"eval/{self.task}/{self.metric}"

    def __str__(self) -> str:
        return f"{self.task}/{self.metric}" + (f":{self.min_delta:g}" if self.min_delta else "")


def parse_gates(specs: list[str], cfg: Any) -> list[Gate]:
    """The --gate values, each checked against the job's eval.harness tasks; ValueError naming a bad one."""
    gates = []
    for spec in specs:
        m = _GATE.match(spec.strip())
        if m is None:
            raise ValueError(f"--gate {spec!r}: expected <task>/<metric>[:min_delta], e.g. arc_easy/acc:0.01")
        try:
            delta = float(m.group("delta") or 0.0)
        except ValueError:
            raise ValueError(f"--gate {spec!r}: min_delta {m.group('delta')!r} is not a number") from None
        gate = Gate(m.group("task"), m.group("metric"), delta)
        if gate.task not in cfg.eval.harness.tasks:
            raise ValueError(f"--gate {spec}: task {gate.task!r} is not in the job's eval.harness.tasks "
                             f"({cfg.eval.harness.tasks or 'none'}); the gate is measured with those settings")
        gates.append(gate)
    return gates


def check_metrics(gates: list[Gate], cfg: Any) -> None:
    """ValueError naming a gate whose metric its task does not report, with the names it does (read from the task's
    config, as the evaluation will label them); a task whose config does not say is left to the evaluation."""
    if not gates:
        return
    from rayspeed.benchmarks.harness import metric_labels, task_manager

    settings = dataclasses.asdict(cfg.eval.harness)
    manager = task_manager(settings)
    for gate in gates:
        labels = metric_labels(gate.task, settings, manager)
        if labels is not None and gate.metric not in labels:
            raise ValueError(f"--gate {gate}: task {gate.task!r} reports no metric {gate.metric!r}; its metrics: "
                             f"{', '.join(labels)} (use one of them, e.g. --gate {gate.task}/{labels[0]})")


def judge(gates: list[Gate], new: dict[str, Any], champion: dict[str, Any], new_version: str,
          champion_version: str) -> tuple[bool, str]:
    """(promote?, why) from both versions' lm-eval results."""
    from rayspeed.benchmarks.harness import higher_is_better, metrics_of

    scores_new, scores_old = metrics_of(new), metrics_of(champion)
    held = []
    for g in gates:
        if g.key not in scores_new or g.key not in scores_old:
            which = "the challenger" if g.key not in scores_new else "the champion"
            have = sorted(k for k in (scores_new if g.key not in scores_new else scores_old) if k.startswith(
                f"eval/{g.task}/")) or "none"
            return False, f"gate {g}: {which}'s evaluation has no {g.key} (its {g.task} scores: {have})"
        a, b = scores_new[g.key], scores_old[g.key]
        up = higher_is_better(new, g.task, g.metric)
        need = b + g.min_delta if up else b - g.min_delta
        slack = 1e-9 * max(1.0, abs(need))  # 0.55 + 0.05 is 0.6000000000000001 in floating point
        ok = a >= need - slack if up else a <= need + slack
        text = (f"gate {g}: version {new_version} {a:.6g} vs champion version {champion_version} {b:.6g} "
                f"({'higher' if up else 'lower'} is better; needs {'>=' if up else '<='} {need:.6g})")
        if not ok:
            return False, text
        held.append(text)
    return True, "; ".join(held)


def score_versions(uri: str, name: str, versions: list[str], cfg: Any) -> list[dict[str, Any]]:
    """Each registered version's lm-eval results with the job's eval.harness settings, got the way an evaluation
    during training gets them (rayspeed.benchmarks.task, a process per version, both at once; CPU unless the job
    uses GPUs): `rayspeed export models:/<name>/<version> --format hf` makes the Hugging Face folder lm-eval loads
    (the version's own logged model: config.json and safetensors with the tokenizer, which MLflow's transformers
    flavor keeps apart under components/tokenizer), then lm-eval scores it. RuntimeError naming a version without
    a result."""
    import os
    import shutil

    from rayspeed.benchmarks.runner import ProcessRunner, wait_all
    from rayspeed.paths import owned_scratch

    settings = dataclasses.asdict(cfg.eval.harness)
    device = "cuda" if cfg.cluster.use_gpu else "cpu"
    # The store reaches the export through the environment, never the command line (`ps` shows it to everyone).
    env = {"MLFLOW_TRACKING_URI": uri, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    runner, scratch = ProcessRunner(), owned_scratch("rayspeed-gate-")
    try:
        for i, v in enumerate(versions):
            runner.submit(i, {"step": i, "checkpoint": f"models:/{name}/{v}", "settings": settings, "device": device,
                              "out": os.path.join(scratch, f"version-{v}"), "env": env})
        done = dict(wait_all(runner, cfg.eval.harness.timeout_s))
    finally:
        runner.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    for i, v in enumerate(versions):
        if i not in done:
            raise RuntimeError(f"version {v}'s evaluation did not finish within eval.harness.timeout_s "
                               f"({cfg.eval.harness.timeout_s:g} s)")
        if "error" in done[i]:
            raise RuntimeError(f"version {v}: {done[i]['error']}")
    return [done[i] for i in range(len(versions))]
