"""`rayspeed retrain --gate <task>/<metric>[:min_delta]`: promotion on benchmark scores, measured the same way on
the champion and the challenger (both registered versions scored now with the job's eval.harness settings: the
same tasks, examples, shots and chat template), not on recorded values.

A gate holds when the challenger's score is at least the champion's plus min_delta in the metric's own direction
(lm-eval's higher_is_better for it): new >= champion + min_delta when higher is better, new <= champion - min_delta
when lower is. min_delta is absolute, in the metric's units, 0 by default (no worse); a negative one tolerates a
drop of that much. With gates, the gates decide alone: val/loss is still measured and recorded, and --margin is
not applied (promote on val/loss by giving no gate). With no champion the first version is promoted, as without
gates; a gate whose score the evaluation does not produce (a task that failed, a metric the task does not have)
rejects, naming it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Optional

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


def score_versions(model_dirs: list[str], cfg: Any) -> list[dict[str, Any]]:
    """Each model directory's lm-eval results with the job's eval.harness settings (CPU unless the job uses GPUs)."""
    from rayspeed.benchmarks.harness import evaluate

    settings = dataclasses.asdict(cfg.eval.harness)
    device = "cuda" if cfg.cluster.use_gpu else "cpu"
    return [evaluate(d, settings, device) for d in model_dirs]


def model_dirs(uri: str, name: str, versions: list[str], storage: str) -> list[str]:
    """The registered versions' Hugging Face folders (downloaded once into the storage's model cache)."""
    from pathlib import Path

    from rayspeed import paths
    from rayspeed.tracking.model_fetch import resolve_init_from

    cache: Optional[str] = str(Path(storage) / ".cache" / "models") if not paths.is_uri(storage) else None
    return [resolve_init_from(f"models:/{name}/{v}", uri, cache) for v in versions]
