"""eval.harness during training: rank 0 hands every N-th committed checkpoint (and always the last one) to an
evaluation of its own (rayspeed.benchmarks: a Ray task, or a background process under --launcher local) and goes
on training; at each step it logs the evaluations that finished, at their checkpoint's step, as
eval/<task>/<metric>, with the full results as eval/step_<N>.json, and keeps them in rank 0's
`state.extra["eval.harness"]` ({step: {key: score}}: a job's own callback may read them, e.g. to stop early). The
end of the job waits for the evaluations still running (eval.harness.timeout_s) so the last scores reach the run
before it closes.

    harness = HarnessCallback(cfg, ctx, tracker)
    events.add(harness)          # after the tracker: its end runs before the tracker closes
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from typing import Any

from rayspeed.benchmarks.harness import metrics_of
from rayspeed.benchmarks.runner import runner_for, wait_all
from rayspeed.checkpoint.manifest import dir_name
from rayspeed.paths import owned_scratch
from rayspeed.train.events import Callback, TrainState

log = logging.getLogger("rayspeed.worker")


class HarnessCallback(Callback):
    def __init__(self, cfg: Any, ctx: Any, tracker: Any):
        self.cfg, self.ctx, self.tracker = cfg, ctx, tracker
        self.h = cfg.eval.harness
        self.settings = dataclasses.asdict(self.h)
        self.committed = 0
        self.runner: Any = None
        self.scratch = ""

    def _runner(self) -> Any:
        if self.runner is None:
            self.runner = runner_for(self.ctx.under_ray, dict(self.h.resources), bool(self.cfg.cluster.use_gpu))
            self.scratch = owned_scratch("rayspeed-eval-")
        return self.runner

    def on_checkpoint_committed(self, state: TrainState, record: dict[str, Any]) -> None:
        if not state.is_rank0:
            return
        self.committed += 1
        step = int(record["step"])
        every = self.h.every_checkpoints
        if not ((every and self.committed % every == 0) or step == self.cfg.train.max_steps):
            return
        checkpoint = os.path.join(self.ctx.experiment_dir, dir_name(step))
        spec = {"step": step, "checkpoint": checkpoint, "out": os.path.join(self._runner_scratch(), dir_name(step)),
                "settings": self.settings, "device": "cuda" if self.cfg.cluster.use_gpu else "cpu",
                "env": {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}}
        self.runner.submit(step, spec)
        log.info("eval.harness: evaluating %s (%s) in the background", dir_name(step), ", ".join(self.h.tasks))

    def _runner_scratch(self) -> str:
        self._runner()
        return self.scratch

    def on_step_end(self, state: TrainState) -> None:
        if state.is_rank0 and self.runner is not None and self.runner.pending:
            for step, results in self.runner.finished():
                self.publish(step, results, state)

    def on_end(self, state: TrainState) -> None:
        if not state.is_rank0 or self.runner is None:
            return
        for step, results in wait_all(self.runner, self.h.timeout_s):
            self.publish(step, results, state)
        shutil.rmtree(self.scratch, ignore_errors=True)

    def on_failure(self, state: TrainState, error: BaseException) -> None:
        if self.runner is not None:
            self.runner.stop()
            shutil.rmtree(self.scratch, ignore_errors=True)

    def publish(self, step: int, results: dict[str, Any], state: TrainState) -> None:
        if "error" in results:
            log.warning("eval.harness: the evaluation of %s failed: %s", dir_name(step), results["error"])
            self.tracker.set_tags({f"rayspeed.eval.step{step}": f"failed: {results['error']}"[:4000]})
            return
        scores = metrics_of(results)
        log.info("eval.harness: %s: %s (export %.1f s, evaluation %.1f s)", dir_name(step),
                 ", ".join(f"{k} {v:.4g}" for k, v in sorted(scores.items())), results.get("export_s", 0.0),
                 results.get("evaluate_s", 0.0))
        self.tracker.log_metrics(scores, step=step)
        state.extra.setdefault("eval.harness", {})[step] = scores
        self.tracker.log_text(json.dumps(results, indent=1), f"eval/step_{step:07d}.json")
