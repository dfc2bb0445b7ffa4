"""The checkpoint benchmark (`scripts/bench.py --only checkpoint`): the same job saved synchronously and
asynchronously in one run, and a resume from the asynchronous checkpoint.

A ~300M-parameter model (fp32, ZeRO-1: about 16 bytes per parameter written, ~4.8 GB per checkpoint) trains on
one CPU worker (`--launcher local`, so the processes stay well under 16 GB: the training state ~7 GB, plus the
async snapshot). Three jobs, one after the other:
  sync    resilience.checkpoint_mode sync, a checkpoint every --every steps, --saves checkpoints;
  async   the same with checkpoint_mode async;
  resume  a new job that starts from the async run's first checkpoint (copied into its folder) and trains to the
          same last step.
The line: params, checkpoint_bytes, sync_stall_s and async_stall_s (medians of the saves' checkpoint/stall_s from
MLflow), stall_ratio, async_write_s (the background part), steps_per_s_during_write (steps that ran while a
background write was in flight, per second of it, from the worker's log) next to steps_per_s (no save running),
each run's wall time and peak memory, same_loss (the resumed run's train/loss equals the sync run's at every step
it trained, to 1e-5; the async run's equals the sync run's too) and the machine's load (what else was running).

    python scripts/bench_checkpoint.py [--every 4] [--saves 2] [--layers 18] [--hidden 1024] [--home DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

WRITTEN = re.compile(r"written in the background in ([0-9.]+) s while (\d+) steps ran")


def _overrides(a: argparse.Namespace, name: str, mode: str) -> list[str]:
    sets = {"name": name, "resilience.checkpoint_mode": mode, "resilience.checkpoint_every_steps": a.every,
            "train.max_steps": a.every * a.saves, "model.hidden_size": a.hidden, "model.num_layers": a.layers,
            "model.num_heads": a.hidden // 64, "model.num_kv_heads": a.hidden // 64,
            "model.ffn_hidden_size": 4 * a.hidden, "model.seq_len": a.seq_len, "train.global_batch_size": 1,
            "train.warmup_steps": 1, "parallel.zero_stage": 1, "train.eval_every_steps": 0,
            "tracking.log_every_steps": 1, "tracking.loss_landscape": "false", "tracking.system_metrics": "false",
            "tracking.charts_every_checkpoints": 0, "health.preflight": "false"}
    return [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]


class PeakRSS:
    """Peak resident memory of a process and its children, sampled every 0.5 s."""

    def __init__(self, pid: int):
        import psutil

        self.proc, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        import psutil

        while not self._stop.wait(0.5):
            try:
                procs = [self.proc] + self.proc.children(recursive=True)
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                pass

    def stop(self) -> float:
        self._stop.set()
        self._t.join(2)
        return self.peak / 2**30


def run_job(home: Path, a: argparse.Namespace, name: str, mode: str) -> dict[str, Any]:
    env = dict(os.environ, RAYSPEED_HOME=str(home), PYTHONUNBUFFERED="1",
               PYTHONPATH=str(ROOT / "platform") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, str(ROOT / "jobs" / "train.py"), "--config", str(ROOT / "configs" / "tiny-cpu.yaml"),
           "--launcher", "local", *_overrides(a, name, mode)]
    t0 = time.time()
    log = open(home / f"{name}.log", "w")
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    rss = PeakRSS(p.pid)
    out, _ = p.communicate(timeout=a.timeout)
    log.close()
    peak = rss.stop()
    summary = next((json.loads(x) for x in reversed(out.splitlines()) if x.startswith("{") and '"status"' in x), {})
    if p.returncode != 0 or summary.get("status") != "finished":
        raise RuntimeError(f"{name} failed (rc {p.returncode}); see {home / (name + '.log')}")
    return {"summary": summary, "wall_s": time.time() - t0, "peak_rss_gib": peak,
            "log": (home / f"{name}.log").read_text()}


def history(home: Path, run_id: str, key: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    return {m.step: m.value for m in c.get_metric_history(run_id, key)}


def _median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def _r(x: Optional[float], n: int = 3) -> Optional[float]:
    return None if x is None else round(float(x), n)


def machine() -> dict[str, Any]:
    """Load and the busiest other processes right now: what else was running."""
    import psutil

    me = {os.getpid(), *[c.pid for c in psutil.Process().children(recursive=True)]}
    procs = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            if p.pid not in me:
                procs.append((p.cpu_percent(None), p))
        except psutil.Error:
            pass
    time.sleep(1.0)
    busy = []
    for _, p in procs:
        try:
            cpu = p.cpu_percent(None)
            if cpu >= 5:
                busy.append({"cpu_pct": round(cpu), "cmd": " ".join(p.info["cmdline"] or [p.info["name"]])[:80]})
        except psutil.Error:
            pass
    vm = psutil.virtual_memory()
    return {"loadavg_1m": round(os.getloadavg()[0], 2), "mem_available_gib": round(vm.available / 2**30, 1),
            "busiest_others": sorted(busy, key=lambda b: -b["cpu_pct"])[:5]}


def bench(a: argparse.Namespace, home: Path) -> dict[str, Any]:
    from rayspeed.config.load import load
    from rayspeed.config.shape import ModelShape

    cfg = load(str(ROOT / "configs" / "tiny-cpu.yaml"), [o for o in _overrides(a, "x", "sync") if o != "--set"])
    params = ModelShape.from_config(cfg.model).params
    before = machine()
    runs = {}
    for name, mode in (("ck-sync", "sync"), ("ck-async", "async")):
        print(f"[bench] checkpoint: {name} ({params / 1e6:.0f}M parameters)", file=sys.stderr, flush=True)
        runs[mode] = run_job(home, a, name, mode)
    # The resume: a new job whose folder holds the async run's first checkpoint (and nothing else).
    first = f"checkpoint_step{a.every:08d}"
    (home / "runs" / "ck-resume").mkdir(parents=True)
    shutil.copytree(home / "runs" / "ck-async" / first, home / "runs" / "ck-resume" / first)
    print("[bench] checkpoint: ck-resume (from the async checkpoint)", file=sys.stderr, flush=True)
    runs["resume"] = run_job(home, a, "ck-resume", "async")
    after = machine()
    ids = {k: r["summary"]["mlflow_run_id"] for k, r in runs.items()}
    loss = {k: history(home, i, "train/loss") for k, i in ids.items()}
    stalls = {k: list(history(home, ids[k], "checkpoint/stall_s").values()) for k in ("sync", "async")}
    writes = list(history(home, ids["async"], "checkpoint/write_s").values())
    step_times = [v for s, v in history(home, ids["sync"], "perf/step_time_s").items() if s % a.every != 1]
    during = [int(n) / float(s) for s, n in WRITTEN.findall(runs["async"]["log"]) if float(s) > 0]

    def same(k: str, steps: list[int]) -> bool:
        return bool(steps) and all(s in loss[k] and abs(loss[k][s] - loss["sync"][s]) <= 1e-5 * abs(loss["sync"][s])
                                   for s in steps)

    resumed = re.search(r"resumed from (checkpoint_step\d+) at step (\d+)", runs["resume"]["log"])
    total = a.every * a.saves
    sync_stall, async_stall = _median(stalls["sync"]), _median(stalls["async"])
    return {
        "bench": "checkpoint", "params": params, "checkpoint_bytes": runs["async"]["summary"]["checkpoint_bytes"],
        "sync_stall_s": _r(sync_stall), "async_stall_s": _r(async_stall),
        "stall_ratio": _r(async_stall / sync_stall if sync_stall and async_stall is not None else None, 4),
        "same_loss": bool(resumed) and same("resume", list(range(a.every + 1, total + 1)))
        and same("async", list(range(1, total + 1))),
        "resumed_from": resumed.group(1) if resumed else None,
        "sync_stalls_s": [_r(x) for x in stalls["sync"]], "async_stalls_s": [_r(x) for x in stalls["async"]],
        "async_write_s": _r(_median(writes)), "async_writes_s": [_r(x) for x in writes],
        "steps_per_s": _r(1 / _median(step_times), 4) if step_times else None,
        "steps_per_s_during_write": _r(_median(during), 4),
        "sync_wall_s": _r(runs["sync"]["wall_s"], 1), "async_wall_s": _r(runs["async"]["wall_s"], 1),
        "resume_wall_s": _r(runs["resume"]["wall_s"], 1),
        "peak_rss_gib": {k: _r(r["peak_rss_gib"], 2) for k, r in runs.items()},
        "summary_checkpoint_stall_s": {k: _r(runs[k]["summary"]["checkpoint_stall_s"]) for k in ("sync", "async")},
        "config": {"hidden": a.hidden, "layers": a.layers, "seq_len": a.seq_len, "every": a.every, "saves": a.saves,
                   "zero_stage": 1, "precision": "fp32", "launcher": "local"},
        "machine_before": before, "machine_after": after,
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=int, default=4, help="steps between checkpoints")
    ap.add_argument("--saves", type=int, default=2, help="checkpoints per run (the last at the last step)")
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed for any one run")
    ap.add_argument("--home", default=None)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args(argv)
    home = Path(a.home).resolve() if a.home else Path(tempfile.mkdtemp(prefix="rayspeed-bench-ckpt-"))
    home.mkdir(parents=True, exist_ok=True)
    rc = 0
    try:
        print(json.dumps(bench(a, home)), flush=True)
    except Exception as e:
        print(f"[bench] checkpoint failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        rc = 1
    finally:
        if a.keep or rc:
            print(f"[bench] scratch folder kept: {home}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(home, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
