"""Where an evaluation runs: a Ray task beside the training job (`--launcher ray`: its own resources, by default no
CPU on a CPU cluster and one GPU on a GPU cluster, so it neither waits for training's resources nor takes them), or
a background process (`--launcher local`). Both run rayspeed.benchmarks.task and leave its results.json; the
training job's rank 0 submits and polls, never waits, except at the end (eval.harness.timeout_s).

    runner = runner_for(under_ray=True, resources={}, use_gpu=False)
    runner.submit(step, spec)            # spec: rayspeed.benchmarks.task's
    for step, results in runner.finished(): ...
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from typing import Any, Iterator, Optional

from rayspeed.benchmarks.task import RESULTS, own_environment

log = logging.getLogger("rayspeed.worker")


def _read(out: str) -> Optional[dict[str, Any]]:
    try:
        with open(os.path.join(out, RESULTS)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class ProcessRunner:
    def __init__(self) -> None:
        self.pending: dict[int, tuple[subprocess.Popen, str]] = {}

    def submit(self, step: int, spec: dict[str, Any]) -> None:
        log_path = os.path.join(spec["out"], "task.log")
        os.makedirs(spec["out"], exist_ok=True)
        # The spec's env goes into the process's environment only: its command line is anyone's to read (`ps`), and
        # env may name a tracking store with its credentials.
        argv = json.dumps({k: v for k, v in spec.items() if k != "env"})
        with open(log_path, "w") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "rayspeed.benchmarks.task", argv], stdout=logf,
                                    stderr=subprocess.STDOUT, env=own_environment(spec.get("env", {})),
                                    start_new_session=True)
        self.pending[step] = (proc, spec["out"])

    def finished(self) -> Iterator[tuple[int, dict[str, Any]]]:
        for step, (proc, out) in sorted(self.pending.items()):
            if proc.poll() is None:
                continue
            del self.pending[step]
            yield step, _read(out) or {"step": step, "error": f"the evaluation exited {proc.returncode} without "
                                                              f"results (see {out}/task.log)"}

    def stop(self) -> None:
        for proc, _ in self.pending.values():
            proc.kill()
        self.pending.clear()


class RayRunner:
    def __init__(self, resources: dict[str, float], use_gpu: bool):
        import ray

        res = dict(resources) or ({"GPU": 1.0} if use_gpu else {})
        options: dict[str, Any] = {"num_cpus": float(res.pop("CPU", 0.0)), "num_gpus": float(res.pop("GPU", 0.0)),
                                   "max_retries": 0}
        if res:
            options["resources"] = res
        self.remote = ray.remote(_ray_task).options(**options)
        self.pending: dict[int, Any] = {}

    def submit(self, step: int, spec: dict[str, Any]) -> None:
        self.pending[step] = self.remote.remote(spec)

    def finished(self) -> Iterator[tuple[int, dict[str, Any]]]:
        import ray

        for step, ref in sorted(self.pending.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            del self.pending[step]
            try:
                yield step, ray.get(ref)
            except Exception as e:  # the task itself failed (its node died, out of memory)
                yield step, {"step": step, "error": f"the evaluation task failed: {type(e).__name__}: {e}"}

    def stop(self) -> None:
        import ray

        for ref in self.pending.values():
            ray.cancel(ref, force=True)
        self.pending.clear()


def _ray_task(spec: dict[str, Any]) -> dict[str, Any]:
    from rayspeed.benchmarks.task import run

    return run(spec)


def runner_for(under_ray: bool, resources: dict[str, float], use_gpu: bool) -> Any:
    return RayRunner(resources, use_gpu) if under_ray else ProcessRunner()


def wait_all(runner: Any, timeout_s: float, poll_s: float = 0.5) -> Iterator[tuple[int, dict[str, Any]]]:
    """Every pending evaluation's results as it finishes, for at most timeout_s; then the rest are stopped."""
    deadline = time.monotonic() + timeout_s
    while runner.pending and time.monotonic() < deadline:
        yield from runner.finished()
        if runner.pending:
            time.sleep(poll_s)
    if runner.pending:
        log.warning("eval.harness: %d evaluation(s) still running after %.0f s (eval.harness.timeout_s): stopped",
                    len(runner.pending), timeout_s)
        runner.stop()
