"""`make bench`: one JSON line per benchmark, each side by side within the same run.

    python scripts/bench.py [--reps 5] [--steps 300] [--log-every 10] [--skip-windows 3] [--zero auto[,2]]
                            [--platform-set KEY=VALUE]...
                            [--only cpu,resilience,planner,gpu,checkpoint,adapters,plan_accuracy,activation_memory,
                                   pipeline_overhead,pipeline_memory,microbatch_memory,context_parallel,moe,dpo,
                                   grpo]
                            [--record-memory] [--home DIR] [--keep]

Lines (in this order; "bench" names each):
  cpu_overhead  The platform (jobs/train.py under Ray Train + DeepSpeed, 2 CPU workers) against a bare
                PyTorch DDP loop (scripts/bare_ddp.py: torchrun-style, one process per worker,
                OMP_NUM_THREADS=1, gloo; Ray gives each worker one thread too), same model, data, global
                batch, micro-batch, seq_len, fp32, fused AdamW on both sides. Steady-state step time = median
                of the timing windows after the first --skip-windows (the platform's perf/step_time_s from
                MLflow, the bare loop's own windows, both timed the same way: perf_counter over --log-every
                steps, the loss read on the host at the window's end). Each repetition runs both, in
                alternating order; overhead_ratio is the median of the per-repetition ratios.
                The headline layout is the planner's choice for the job (zero_stage auto: ZeRO-0 on 2 CPU
                workers, the same algorithm as DDP); --zero auto,2 adds the demo config's ZeRO-2 as `zero2`.
                cpu_cost_ratio: CPU seconds per steady-state step of each side's whole process tree (platform:
                driver, Ray's daemons and actors, workers; bare: torchrun's agent and workers), a companion
                that a neighbour's burst on a shared machine moves far less than wall-clock windows.
                startup_s: process start to the end of the first training step.
                recovery_s / checkpoint_stall_s: copied from the resilience line.
  resilience    The kill drill (rank 1 killed at step 12, checkpoints every 5 steps): recovery_s = failure to
                the first step finished after the restart; checkpoint_stall_s = median stall of a save.
                Read from summary.json when it carries them, else from MLflow, else derived (see `*_source`).
  planner_512   The planner's layout search for a 512-GPU job (Llama-70B shape on 64 x 8 H100):
                in-process search time (median of 7) and the `rayspeed plan --json` command end to end.
  plan_accuracy `rayspeed calibrate --config configs/tiny-cpu.yaml --workers 2` into a profile, then the tiny-cpu
                job with cluster.profile set (60 steps): the plan's step time against the measured steady-state
                one (plan/predicted_step_time_s vs plan/measured_step_time_s, median of the windows after 10
                warm-up steps), and the error. Not in the default --only: it is a measurement, ~3 minutes.
  activation_memory  scripts/saved_activations.py: per shape (4), dtype (fp32, bf16) and activation_checkpointing
                mode, the bytes per token one block keeps for backward, measured on CPU with saved_tensors_hooks,
                against the planner's (planner.memory activation_bytes' kept term): predicted_bytes_per_token_per_block,
                measured, ratio (measured / predicted).
                Not in the default --only; a few seconds.
  pipeline_overhead  scripts/bench_pipeline_overhead.py: DeepSpeed's pipeline engine (pp = 2, gloo, the platform's
                own engine) on a model too small to compute, step time against the number of micro-batches: the
                engine's host cost per micro-batch per stage (planner hardware.pipe_host_mb_us). Not in the default
                --only; about 1-2 minutes.
  pipeline_memory  scripts/bench_pipeline_memory.py: peak memory per pipeline stage (RSS above the step's start)
                under DeepSpeed's 1F1B schedule, pp = 2, 4 and 8 gloo ranks, 2 blocks per stage, from one
                micro-batch to more than the depth, beside what the planner says that step allocates per stage
                (activations, loss, gradients): the micro-batches each stage keeps in flight. About a minute.
  microbatch_memory  scripts/bench_microbatch_memory.py: the same for one rank at micro-batch 1, 2, 4, 8 and 16
                (256 tokens each, 4 blocks). Seconds. With --record-memory both are written to
                tests/planner/measured_memory.json, which the planner's tests read.
  context_parallel  scripts/bench_context_parallel.py: peak memory per rank (RSS above a baseline taken after the
                model is built) of one 4096-token sequence through a 4-layer model, forward and backward, at cp 1
                and at cp 2 (ulysses, ring), 2 gloo ranks, beside the planner's activations + logits + gradients
                for the same layout: measured_mib, predicted_mib, ratio. About 30 seconds.
  moe_experts   scripts/bench_moe.py: one mixture-of-experts layer (2048 tokens, 32 experts, top 4), forward and
                backward, its experts as grouped matrix products (rayspeed's layer) against a Python loop over the
                experts on the same weights: grouped_ms, loop_ms, loop_over_grouped, max_abs_diff (outputs and
                gradients). A few seconds.
  dpo_reference scripts/bench_dpo.py: one DPO micro-batch (4 pairs of 256 tokens) forward and backward with the
                reference's log-probabilities precomputed against a resident frozen copy scoring it: both step times,
                their ratio beside the planner's assumption (4/3), the copy's MiB, the loss difference. Seconds.
  grpo          GRPO on the example (configs/tiny-grpo-cpu.yaml): rayspeed under Ray Train (2 CPU workers) against
                TRL 1.16's GRPOTrainer (scripts/bench_grpo_trl.py, one process) in the same run, 30 steps each:
                steady-state steps/s and generated tokens/s after 5 steps, rayspeed's sampling-only tokens/s, the
                weight sync (none when colocated), steps_per_s_ratio (rayspeed over TRL).
  gpu           scripts/bench_gpu.py's lines when a CUDA device is present, else a `skipped` line.
  checkpoint    scripts/bench_checkpoint.py: a ~300M-parameter job (--launcher local) saved synchronously and
                asynchronously, and resumed from the async checkpoint: sync_stall_s, async_stall_s, stall_ratio,
                steps/s while the background write runs, both runs' wall time, same_loss.
  adapters      the same model (512 wide, 8 layers, seq 256) fine-tuned in full and with LoRA rank 16 on every
                linear layer, one CPU worker (--launcher local), ZeRO-2: full_step_s / lora_step_s (median after
                10 steps) and each engine's model-state bytes per rank, side by side; about 13 minutes on 2 cores.

Everything runs in a scratch RAYSPEED_HOME (its own mlflow.db and runs/), deleted unless --keep.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform as _platform
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
PY = sys.executable
try:
    import rayspeed  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "platform"))

FIRST_STEP = re.compile(r"first step done ([0-9.]+) s after")


def _median(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _r(x: Optional[float], n: int = 4) -> Optional[float]:
    return None if x is None else round(float(x), n)


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _note(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- CPU accounting


class TreeCPU:
    """CPU seconds (user + system) used by a process and all its descendants, sampled on a thread.

    The machines these run on are shared: another job's burst stretches wall-clock windows by tens of percent,
    but barely changes the CPU time a step costs. So next to the step time, each run gets the CPU seconds its
    whole process tree (for the platform: driver, Ray's daemons and actors, workers; for the bare loop:
    torchrun's agent and the workers) spends per training step in the steady state. Exited processes keep
    their last reading, so the total only grows."""

    def __init__(self, pid: int, interval_s: float = 0.2, rescan_s: float = 2.0):
        import psutil

        self._psutil = psutil
        self.root = psutil.Process(pid)
        self.interval_s, self.rescan_s = interval_s, rescan_s
        self.samples: list[tuple[float, float]] = []
        self._procs: dict[tuple[int, float], Any] = {}
        self._last: dict[tuple[int, float], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-treecpu", daemon=True)
        self._thread.start()

    def _rescan(self) -> None:
        ps = self._psutil
        try:
            found = [self.root] + self.root.children(recursive=True)
        except ps.Error:
            return
        for p in found:
            try:
                self._procs.setdefault((p.pid, p.create_time()), p)
            except ps.Error:
                pass

    def _loop(self) -> None:
        next_scan = 0.0
        while not self._stop.is_set():
            now = time.time()
            if now >= next_scan:
                self._rescan()
                next_scan = now + self.rescan_s
            for key, p in list(self._procs.items()):
                try:
                    ct = p.cpu_times()
                    self._last[key] = ct.user + ct.system
                except self._psutil.Error:
                    self._procs.pop(key, None)
            self.samples.append((time.time(), dict(self._last)))
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def at(self, t: float, keys: Optional[set] = None) -> Optional[float]:
        """CPU seconds used by time t (linear between samples), by all processes or those in `keys`."""
        xs = self.samples
        if len(xs) < 2 or t < xs[0][0] or t > xs[-1][0]:
            return None
        lo, hi = 0, len(xs) - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if xs[mid][0] <= t:
                lo = mid
            else:
                hi = mid

        def total(d: dict) -> float:
            return sum(v for k, v in d.items() if keys is None or k in keys)

        (t0, d0), (t1, d1) = xs[lo], xs[hi]
        c0, c1 = total(d0), total(d1)
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c0

    def busiest(self, t0: float, t1: float, n: int) -> set:
        """The n processes that used the most CPU between t0 and t1 (the training processes)."""
        first = next((d for t, d in self.samples if t >= t0), {})
        last = next((d for t, d in reversed(self.samples) if t <= t1), {})
        use = sorted(((v - first.get(k, 0.0), k) for k, v in last.items()), reverse=True)
        return {k for _, k in use[:n]}


def cpu_split(tree: TreeCPU, ends: list[tuple[int, float]], skip: int, workers: int) -> Optional[dict[str, float]]:
    """Steady-state CPU between the end of window `skip` and the end of the last window (ends = [(step, epoch s at
    the window's end)]): the training processes' CPU seconds per step, the rest of the tree in cores (it runs
    by the second, not by the step), and the whole tree per step."""
    if len(ends) <= skip + 1:
        return None
    (s0, t0), (s1, t1) = ends[max(0, skip - 1)], ends[-1]
    if s1 <= s0 or t1 <= t0:
        return None
    w = tree.busiest(t0, t1, workers)
    vals = [tree.at(t0), tree.at(t1), tree.at(t0, w), tree.at(t1, w)]
    if any(v is None for v in vals):
        return None
    a0, a1, w0, w1 = vals
    return {"worker_cpu_s_per_step": (w1 - w0) / (s1 - s0) / workers,
            "background_cores": ((a1 - a0) - (w1 - w0)) / (t1 - t0),
            "tree_cpu_s_per_step": (a1 - a0) / (s1 - s0)}


def projected_ratio(p: dict[str, float], b: dict[str, float], cores: int) -> float:
    """Step-time ratio on an otherwise idle machine whose `cores` cores the workers fill (one each): each
    side's per-worker CPU per step, stretched by the share of the cores its background takes."""
    return (p["worker_cpu_s_per_step"] / max(1e-9, cores - p["background_cores"])) / (
        b["worker_cpu_s_per_step"] / max(1e-9, cores - b["background_cores"]))


# ---------------------------------------------------------------- the platform


def _mlflow_client(home: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")


def metric_history(home: Path, run_id: str, key: str) -> list[tuple[int, float, int]]:
    """[(step, value, timestamp_ms)] of one MLflow metric, by step."""
    hist = _mlflow_client(home).get_metric_history(run_id, key)
    return sorted((m.step, m.value, m.timestamp) for m in hist)


def steady_state(windows: list[float], skip: int) -> Optional[float]:
    """Median step time over the windows after the first `skip` (warm-up); all of them if too few."""
    if not windows:
        return None
    kept = windows[skip:] if len(windows) > skip else windows
    return statistics.median(kept)


def run_platform(home: Path, config: str, name: str, overrides: list[str], timeout_s: float,
                 options: tuple[str, ...] | list[str] = (),
                 env_extra: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Run jobs/train.py in its own process; return the summary, the output's first-step lines and timings."""
    env = dict(os.environ, RAYSPEED_HOME=str(home), **(env_extra or {}))
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [PY, str(ROOT / "jobs" / "train.py"), "--config", config, "--set", f"name={name}", *options]
    for o in overrides:
        cmd += ["--set", o]
    log_path = home / f"{name}.log"
    first_steps: list[tuple[float, float]] = []  # (arrival time, seconds after launch as the worker said)
    summary_line = None
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        tree = TreeCPU(proc.pid)
        killer = threading.Timer(timeout_s, proc.kill)  # a silent hang must not hang the benchmark
        killer.start()
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                now = time.time()
                log.write(line)
                m = FIRST_STEP.search(line)
                if m:
                    first_steps.append((now, float(m.group(1))))
                if line.startswith("{") and '"status"' in line:
                    summary_line = line
            rc = proc.wait()
        finally:
            killer.cancel()
            tree.stop()
    t_end = time.time()
    summary: dict[str, Any] = {}
    try:
        summary = json.loads((home / "runs" / name / "summary.json").read_text())
    except (OSError, ValueError):
        if summary_line:
            summary = json.loads(summary_line)
    out = {"rc": rc, "summary": summary, "first_steps": first_steps, "t_start": t0, "wall_s": t_end - t0,
           "log": str(log_path), "name": name, "tree": tree}
    run_id = summary.get("mlflow_run_id")
    if rc != 0 or summary.get("status") != "finished":
        tail = "".join(open(log_path).readlines()[-15:])
        raise RuntimeError(f"platform run {name} failed (exit {rc}); last lines of {log_path}:\n{tail}")
    if run_id:
        out["step_times"] = metric_history(home, run_id, "perf/step_time_s")
        # The worker logs its first metrics right after its first step (stamped then, in ms).
        firsts = [ts for st, _, ts in metric_history(home, run_id, "resilience/world_size") if st == 1]
        out["first_metric_at"] = min(firsts) / 1000.0 if firsts else None
    return out


def platform_first_step_at(res: dict[str, Any], which: int = 0) -> Optional[float]:
    """Epoch seconds at which attempt `which` finished its first step: the summary's own field if it has one,
    else (first attempt) the MLflow stamp of the metrics logged at step 1, else the moment the worker's
    "first step done" line reached this process (Ray forwards worker output within about a second)."""
    s = res["summary"]
    if which == 0 and s.get("first_step_at"):
        return float(s["first_step_at"])
    if which == 0 and res.get("first_metric_at"):
        return float(res["first_metric_at"])
    fs = res["first_steps"]
    if len(fs) <= which:
        return None
    return fs[which][0]


# ---------------------------------------------------------------- the bare loop


def run_bare(home: Path, config: str, steps: int, log_every: int, timeout_s: float,
             extra: tuple[str, ...] = ()) -> dict[str, Any]:
    env = dict(os.environ, RAYSPEED_HOME=str(home))
    env.pop("OMP_NUM_THREADS", None)  # bare_ddp sets 1 per process, as torchrun does
    out_file = home / "bare.json"
    if out_file.exists():
        out_file.unlink()
    t0 = time.time()
    env["RAYSPEED_BARE_LAUNCHED_AT"] = repr(t0)
    cmd = [PY, str(ROOT / "scripts" / "bare_ddp.py"), "--config", config, "--steps", str(steps),
           "--log-every", str(log_every), "--json-out", str(out_file), *extra]
    with open(home / "bare.log", "a") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT)
        tree = TreeCPU(proc.pid)
        try:
            rc = proc.wait(timeout=timeout_s)
        finally:
            tree.stop()
            if proc.poll() is None:
                proc.kill()
    if rc != 0 or not out_file.exists():
        tail = "".join(open(home / "bare.log").readlines()[-15:])
        raise RuntimeError(f"bare loop failed (exit {rc}):\n{tail}")
    res = json.loads(out_file.read_text())["bare_ddp"]
    res["t_start"] = t0
    res["wall_s"] = time.time() - t0
    res["tree"] = tree
    return res


# ---------------------------------------------------------------- benchmarks


def bench_cpu(args, home: Path) -> dict[str, Any]:
    zeros = [z.strip() for z in args.zero.split(",") if z.strip()]
    common = [f"train.max_steps={args.steps}", f"tracking.log_every_steps={args.log_every}",
              "resilience.checkpoint_every_steps=0", "train.eval_every_steps=0", *args.platform_set]
    bare: list[dict] = []
    plat: dict[str, list[dict]] = {z: [] for z in zeros}
    for rep in range(args.reps):
        # Alternate the order (bare first, then the platform first) so a drift in the machine's speed does not
        # always favour the same side.
        order = ["bare", *zeros] if rep % 2 == 0 else [*zeros, "bare"]
        for what in order:
            _note(f"cpu rep {rep + 1}/{args.reps}: {'bare DDP' if what == 'bare' else f'platform zero_stage={what}'}")
            if what == "bare":
                bare.append(run_bare(home, args.config, args.steps, args.log_every, args.timeout))
            else:
                plat[what].append(run_platform(home, args.config, f"bench-cpu-z{what}-r{rep}-{args.tag}",
                                               common + [f"parallel.zero_stage={what}"], args.timeout))

    bare_steady = [steady_state(b["window_step_s"], args.skip_windows) for b in bare]
    bare_startup = [b["first_step_at"] - b["t_start"] for b in bare]
    workers = bare[0]["world_size"]
    cores = os.cpu_count() or workers
    bare_cpu = []
    for b in bare:
        steps_at = [min(args.steps, (i + 1) * args.log_every) for i in range(len(b["window_end_at"]))]
        bare_cpu.append(cpu_split(b["tree"], list(zip(steps_at, b["window_end_at"])), args.skip_windows, workers))

    def pair_ratios(xs: list, ys: list) -> list[float]:
        return [x / y for x, y in zip(xs, ys) if x and y]

    def layout_stats(z: str) -> dict[str, Any]:
        runs = plat[z]
        steady = [steady_state([v for _, v, _ in r["step_times"]], args.skip_windows) for r in runs]
        cpu = [cpu_split(r["tree"], [(st, ts / 1000.0) for st, _, ts in r["step_times"]], args.skip_windows, workers)
               for r in runs]
        ratios = pair_ratios(steady, bare_steady)
        cpu_ratios = pair_ratios([c and c["tree_cpu_s_per_step"] for c in cpu],
                                 [c and c["tree_cpu_s_per_step"] for c in bare_cpu])
        worker_ratios = pair_ratios([c and c["worker_cpu_s_per_step"] for c in cpu],
                                    [c and c["worker_cpu_s_per_step"] for c in bare_cpu])
        projected = [projected_ratio(c, d, cores) for c, d in zip(cpu, bare_cpu) if c and d]
        startup = [(platform_first_step_at(r) or float("nan")) - r["t_start"] for r in runs]
        return {
            "zero_stage_requested": z,
            "platform_step_s": _r(_median(steady), 5),
            "overhead_ratio": _r(_median(ratios)),
            "overhead_ratios": [_r(x) for x in ratios],
            "projected_idle_ratio": _r(_median(projected)),
            "projected_idle_ratios": [_r(x) for x in projected],
            "worker_cpu_ratio": _r(_median(worker_ratios)),
            "background_cores": _r(_median([c["background_cores"] for c in cpu if c]), 3),
            "platform_cpu_s_per_step": _r(_median([c["tree_cpu_s_per_step"] for c in cpu if c]), 5),
            "cpu_cost_ratio": _r(_median(cpu_ratios)),
            "cpu_cost_ratios": [_r(x) for x in cpu_ratios],
            "startup_s": _r(_median(startup), 2),
            "run_wall_s": _r(_median([r["wall_s"] for r in runs]), 1),
            "final_loss": runs[-1]["summary"].get("final_loss"),
        }

    by = {z: layout_stats(z) for z in zeros}
    head = by[zeros[0]]
    from rayspeed.config.load import load
    from rayspeed.planner import resolve

    cfg, _ = resolve(load(args.config, [f"parallel.zero_stage={zeros[0]}"]), world_size=None)
    p = cfg.parallel
    line = {
        "bench": "cpu_overhead",
        "config": os.path.relpath(args.config, ROOT) if os.path.isabs(args.config) else args.config,
        "layout": {"dp": p.dp, "tp": p.tp, "pp": p.pp, "zero_stage": p.zero_stage,
                   "micro_batch_size": p.micro_batch_size, "grad_accum": p.grad_accum},
        "workers": cfg.cluster.max_workers, "threads_per_worker": 1, "dtype": cfg.train.precision,
        "global_batch_size": cfg.train.global_batch_size, "seq_len": cfg.model.seq_len,
        "steps": args.steps, "log_every": args.log_every, "skip_windows": args.skip_windows, "reps": args.reps,
        **({"platform_set": args.platform_set} if args.platform_set else {}),
        "overhead_ratio": head["overhead_ratio"],
        "platform_step_s": head["platform_step_s"],
        "bare_step_s": _r(_median(bare_steady), 5),
        "startup_s": head["startup_s"],
        "bare_startup_s": _r(_median(bare_startup), 2),
        "recovery_s": None,
        "checkpoint_stall_s": None,
        "overhead_ratios": head["overhead_ratios"],
        "bare_step_s_runs": [_r(x, 5) for x in bare_steady],
        "projected_idle_ratio": head["projected_idle_ratio"],
        "worker_cpu_ratio": head["worker_cpu_ratio"],
        "background_cores": head["background_cores"],
        "bare_background_cores": _r(_median([c["background_cores"] for c in bare_cpu if c]), 3),
        "cpu_cost_ratio": head["cpu_cost_ratio"],
        "platform_cpu_s_per_step": head["platform_cpu_s_per_step"],
        "bare_cpu_s_per_step": _r(_median([c["tree_cpu_s_per_step"] for c in bare_cpu if c]), 5),
        "cpu_cost_ratios": head["cpu_cost_ratios"],
        "projected_idle_ratios": head["projected_idle_ratios"],
        "final_loss": head["final_loss"],
        "bare_final_loss": bare[-1].get("final_loss"),
    }
    for z in zeros[1:]:
        line[f"zero{z}"] = {k: v for k, v in by[z].items() if k != "zero_stage_requested"}
    return line


def bench_resilience(args, home: Path) -> dict[str, Any]:
    """The kill drill, `--reps` times each side, alternated: the platform (rank 1 SIGKILLs itself at step 12 of a
    20-step job, checkpoints every 5; Ray Train restarts the group, which resumes from step 10) and bare torchrun
    (`--max-restarts 1`, the same rank and step; torchrun restarts every process, from step 0: it has no
    checkpoint). recovery_from_kill_s on both sides: the kill's own time stamp to the first step the new group
    finishes. The platform's recovery_s (its summary) counts from when Ray Train saw the failure instead."""
    kill_rank, kill_step, every = 1, 12, 5
    plat, bare, loads, last = [], [], [], {}
    for rep in range(args.reps):
        for what in (["bare", "platform"] if rep % 2 == 0 else ["platform", "bare"]):
            loads.append(os.getloadavg()[0])
            _note(f"resilience rep {rep + 1}/{args.reps}: {what} kill drill (rank {kill_rank} at step {kill_step})")
            if what == "bare":
                marker = home / "bare-kill.time"
                marker.unlink(missing_ok=True)
                drill = ("--kill", f"{kill_rank}:{kill_step}", "--kill-marker", str(marker), "--max-restarts", "1")
                b = run_bare(home, args.config, 20, 5, args.timeout, drill)
                assert b["attempt"] == 1, "torchrun did not restart the group"
                bare.append(b["first_step_at"] - float(marker.read_text()))
                continue
            last = _platform_drill(args, home, f"bench-kill-r{rep}-{args.tag}", kill_rank, kill_step, every)
            plat.append(last.pop("recovery_from_kill_s"))
    out = {"bench": "resilience", "config": args.config, "kill": {"rank": kill_rank, "step": kill_step},
           "checkpoint_every_steps": every, "reps": args.reps, **last,
           "recovery_from_kill_s": _r(_median(plat), 2), "bare_recovery_s": _r(_median(bare), 2),
           "recovery_ratio": _r((_median(plat) or 0) / (_median(bare) or 1), 2),
           "recovery_from_kill_s_runs": [_r(x, 2) for x in plat], "bare_recovery_s_runs": [_r(x, 2) for x in bare],
           "load_1m_at_starts": [_r(x, 2) for x in loads]}
    return out


def _platform_drill(args, home: Path, name: str, kill_rank: int, kill_step: int, every: int) -> dict[str, Any]:
    res = run_platform(home, args.config, name, [
        "train.max_steps=20", "tracking.log_every_steps=5", f"resilience.checkpoint_every_steps={every}",
        "train.eval_every_steps=0", f"chaos.kill_rank_at_step={{rank: {kill_rank}, step: {kill_step}}}",
    ], args.timeout)
    s = res["summary"]
    out: dict[str, Any] = {"restarts": s.get("restarts"), "lost_steps": (kill_step - 1) % every}
    run_id = s.get("mlflow_run_id")
    rec, rec_src = s.get("recovery_s"), "summary.json"
    hist = metric_history(home, run_id, "resilience/recovery_s") if run_id else []
    if rec is None and hist:
        rec, rec_src = max(v for _, v, _ in hist), "mlflow resilience/recovery_s"
    # The restarted rank 0 logs resilience/recovery_s when its first step ends: that record's time stamp.
    markers = sorted((home / "runs" / name / ".chaos").glob(f"kill*_rank{kill_rank}_step{kill_step}"))
    from_kill = hist[-1][2] / 1000 - float(markers[0].read_text().strip()) if markers and hist else None
    stall, stall_src = s.get("checkpoint_stall_s"), "summary.json"
    stalls: list[float] = []
    if run_id:
        stalls = [v for _, v, _ in metric_history(home, run_id, "perf/checkpoint_stall_s")]
    if stall is None:
        stall = _median(stalls)
        stall_src = "mlflow perf/checkpoint_stall_s (median)" if stalls else "unavailable"
    out.update({"recovery_s": _r(rec, 2), "recovery_source": rec_src, "recovery_from_kill_s": from_kill,
                "checkpoint_stall_s": _r(stall, 3), "checkpoint_stall_source": stall_src,
                "checkpoint_stalls_s": [_r(x, 3) for x in stalls],
                "startup_s": _r((platform_first_step_at(res) or float("nan")) - res["t_start"], 2),
                "run_wall_s": _r(res["wall_s"], 1)})
    return out


START_LINE = re.compile(r"start: ([0-9.]+) s from the command to the first step \((.*)\)")


class JoinedHead:
    """A Ray head started like `make up` (`ray start --head`, token auth) that the jobs join through RAY_ADDRESS,
    as `make submit`'s do; stopped with its process group."""

    def __init__(self, home: Path):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.env = dict(os.environ, RAY_AUTH_MODE="token")
        ray_bin = str(Path(PY).parent / "ray")
        subprocess.run([ray_bin, "get-auth-token", "--generate"], check=True, stdout=subprocess.DEVNULL, env=self.env)
        self.log = open(home / "ray-head.log", "w")
        self.proc = subprocess.Popen([ray_bin, "start", "--head", "--block", "--port", str(self.port), "--num-cpus",
                                      "8", "--include-dashboard=false", "--disable-usage-stats"],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env)
        from ray._private.services import get_node_ip_address

        self.address = f"{get_node_ip_address()}:{self.port}"
        deadline = time.time() + 120
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    time.sleep(3)  # the raylet comes up right after the GCS
                    return
            time.sleep(0.5)
        raise RuntimeError(f"ray head did not start: {home / 'ray-head.log'}")

    def stop(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def bench_startup(args, home: Path) -> dict[str, Any]:
    """Command to first step, 2-step jobs: the platform joined to a running cluster (`make submit`'s case) and the
    bare torchrun-style loop, alternated, `--reps` each; the platform's phases from its `start:` line (medians)."""
    head = JoinedHead(home)
    plat, bare, phases, loads = [], [], [], []
    try:
        for rep in range(args.reps):
            for what in (["bare", "platform"] if rep % 2 == 0 else ["platform", "bare"]):
                loads.append(os.getloadavg()[0])
                _note(f"startup rep {rep + 1}/{args.reps}: {what}")
                if what == "bare":
                    b = run_bare(home, args.config, 2, 1, args.timeout)
                    bare.append(b["first_step_at"] - b["t_start"])
                    continue
                r = run_platform(home, args.config, f"bench-start-r{rep}-{args.tag}",
                                 ["train.max_steps=2", "tracking.log_every_steps=1", "train.eval_every_steps=0",
                                  "resilience.checkpoint_every_steps=0"], args.timeout,
                                 env_extra={"RAY_ADDRESS": head.address, "RAY_AUTH_MODE": "token"})
                plat.append((platform_first_step_at(r) or float("nan")) - r["t_start"])
                m = next((START_LINE.search(ln) for ln in open(r["log"]) if START_LINE.search(ln)), None)
                if m:
                    phases.append({k: float(v.rstrip(" s")) for k, v in
                                   (p.strip().rsplit(" ", 2)[0:2] for p in m.group(2).split(","))})
    finally:
        head.stop()
    med = {k: _r(_median([p[k] for p in phases if k in p]), 2) for k in (phases[0] if phases else {})}
    return {"bench": "startup_joined", "config": args.config, "reps": args.reps,
            "startup_s": _r(_median(plat), 2), "bare_startup_s": _r(_median(bare), 2),
            "startup_ratio": _r((_median(plat) or 0) / (_median(bare) or 1), 2),
            "startup_s_runs": [_r(x, 2) for x in plat], "bare_startup_s_runs": [_r(x, 2) for x in bare],
            "phases_s": med, "load_1m_at_starts": [_r(x, 2) for x in loads]}


def bench_planner(args) -> dict[str, Any]:
    from rayspeed.config.load import load
    from rayspeed.planner import plan_job

    config = str(ROOT / "configs" / "llama-70b-64xh100.yaml")
    overrides = ["cluster.num_nodes=64", "cluster.num_workers=512"]
    cfg = load(config, overrides)
    times, res = [], None
    for _ in range(7):
        t0 = time.perf_counter()
        res = plan_job(cfg)
        times.append(time.perf_counter() - t0)
    cli_times = []
    cmd = [PY, "-m", "rayspeed", "plan", config, "--json"] + [a for o in overrides for a in ("--set", o)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "platform") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        cli_times.append(time.perf_counter() - t0)
    b = res.best
    return {
        "bench": "planner_512", "config": "configs/llama-70b-64xh100.yaml", "set": overrides, "gpus": 512,
        "search_s": _r(_median(times), 4), "search_s_max": _r(max(times), 4),
        "cli_s": _r(_median(cli_times), 3),
        "plan": {k: b.get(k) for k in ("dp", "tp", "pp", "zero_stage", "micro_batch_size", "grad_accum",
                                        "activation_checkpointing", "step_time_s", "mfu", "memory_gib_per_gpu")},
    }


def bench_plan_accuracy(args, home: Path) -> dict[str, Any]:
    env = dict(os.environ, RAYSPEED_HOME=str(home),
               PYTHONPATH=str(ROOT / "platform") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MLFLOW_TRACKING_URI", None)
    profile = home / "profile.json"
    t0 = time.perf_counter()
    cal = subprocess.run([PY, "-m", "rayspeed", "calibrate", "--config", args.config, "--workers", "2", "--out",
                          str(profile)], env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=args.timeout)
    calibrate_s = time.perf_counter() - t0
    if cal.returncode != 0:
        raise RuntimeError(f"rayspeed calibrate failed (exit {cal.returncode}):\n{cal.stdout[-2000:]}")
    res = run_platform(home, args.config, f"plan-accuracy-{args.tag}",
                       [f"cluster.profile={profile}", "train.max_steps=60"], args.timeout)
    run_id = res["summary"].get("mlflow_run_id")

    def last(key: str) -> Optional[float]:
        h = metric_history(home, run_id, key) if run_id else []
        return h[-1][1] if h else None

    pred, meas = last("plan/predicted_step_time_s"), last("plan/measured_step_time_s")
    return {"bench": "plan_accuracy", "config": args.config, "workers": 2, "calibrate_s": _r(calibrate_s, 1),
            "predicted_step_time_s": _r(pred, 4), "measured_step_time_s": _r(meas, 4),
            "error": _r(pred / meas - 1.0, 3) if pred and meas else None, "within_25pct": bool(
                pred and meas and abs(pred / meas - 1.0) <= 0.25), "loadavg": os.getloadavg()[0]}


def bench_activation_memory(args) -> list[dict[str, Any]]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("saved_activations", ROOT / "scripts" / "saved_activations.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.all_cases()


def bench_pipeline_overhead(args) -> list[dict[str, Any]]:
    _note("pipeline_overhead: DeepSpeed's pipeline engine per micro-batch (scripts/bench_pipeline_overhead.py)")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "platform"))
    proc = subprocess.run([PY, str(ROOT / "scripts" / "bench_pipeline_overhead.py")], cwd=str(ROOT), env=env,
                          stdout=subprocess.PIPE, text=True)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return lines or [{"bench": "pipeline_overhead", "status": "failed", "rc": proc.returncode}]


def _script_lines(script: str, bench: str, extra_env: Optional[dict[str, str]] = None,
                  script_args: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The JSON lines a benchmark script prints (one failed line naming it when it prints none)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "platform"), **(extra_env or {}))
    proc = subprocess.run([PY, str(ROOT / "scripts" / script), *script_args], cwd=str(ROOT), env=env,
                          stdout=subprocess.PIPE, text=True)
    # '{"': a JSON line, not a library's printed dict (TRL prints its logs as Python dicts)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"')]
    return lines or [{"bench": bench, "status": "failed", "rc": proc.returncode}]


MEMORY_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
# Pipeline depths 2-8, each from one micro-batch to more than its depth (1F1B's in-flight count saturates at pp).
PIPELINE_SWEEP = (("2", "1,2,4"), ("4", "1,4,8"), ("8", "1,8,16"))
MEASURED_MEMORY = ROOT / "tests" / "planner" / "measured_memory.json"
RECORD_COMMAND = "python scripts/bench.py --only pipeline_memory,microbatch_memory --record-memory"


def bench_pipeline_memory(args) -> list[dict[str, Any]]:
    _note("pipeline_memory: peak memory per pipeline stage under 1F1B, pp 2, 4, 8 (scripts/bench_pipeline_memory.py)")
    return [line for pp, ms in PIPELINE_SWEEP
            for line in _script_lines("bench_pipeline_memory.py", "pipeline_memory", MEMORY_ENV,
                                      ("--pp", pp, "--ms", ms))]


def bench_microbatch_memory(args) -> list[dict[str, Any]]:
    _note("microbatch_memory: peak memory of a step at micro-batch 1-16 (scripts/bench_microbatch_memory.py)")
    return _script_lines("bench_microbatch_memory.py", "microbatch_memory", MEMORY_ENV)


def record_memory(lines: list[dict[str, Any]], stamp: dict) -> None:
    """The memory lines beside the planner's predictions, checked in for the planner's tests to read
    (tests/planner/test_measured_memory.py)."""
    rows = [line for line in lines if line.get("bench") in ("pipeline_memory", "microbatch_memory")
            and "measured_mib" in line]
    MEASURED_MEMORY.write_text(json.dumps({"command": RECORD_COMMAND, **stamp, "rows": rows}, indent=1) + "\n")
    _note(f"recorded {len(rows)} memory lines in {MEASURED_MEMORY.relative_to(ROOT)}")


def bench_context_parallel(args) -> list[dict[str, Any]]:
    _note("context_parallel: peak memory per rank at cp 1 and cp 2 (scripts/bench_context_parallel.py), and the MLP "
          "whole and in tiles (scripts/bench_mlp_tiles.py)")
    env = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    return (_script_lines("bench_context_parallel.py", "context_parallel", env)
            + _script_lines("bench_mlp_tiles.py", "mlp_tiles", env))


def bench_moe(args) -> list[dict[str, Any]]:
    _note("moe: grouped experts against a loop over them (scripts/bench_moe.py)")
    return _script_lines("bench_moe.py", "moe_experts")


def bench_dpo(args) -> list[dict[str, Any]]:
    _note("dpo: a DPO step with a precomputed against a resident reference (scripts/bench_dpo.py)")
    return _script_lines("bench_dpo.py", "dpo_reference")


GRPO_STEPS, GRPO_SKIP = 30, 5


def bench_grpo(args, home: Path) -> dict[str, Any]:
    """GRPO on the example (scripts/make_tiny_sum_model.py, configs/tiny-grpo-cpu.yaml: 8 prompts x 8 completions of
    at most 3 tokens per step): rayspeed (jobs/train.py under Ray Train, 2 CPU workers, colocated rollouts) against
    TRL 1.16's GRPOTrainer (one process, use_cpu) in the same run, 30 steps each. Steady-state steps/s after the
    first 5 steps (rayspeed: the MLflow stamps of `reward`, logged every step; TRL: its step-end callback), generated
    tokens/s (completions/mean_length x completions / those seconds), rayspeed's own rollout/tokens_per_s (sampling
    alone) and the weight sync (none: colocated workers sample with their own weights)."""
    import importlib.util

    _note("grpo: rayspeed (2 Ray workers) against TRL's GRPOTrainer on the GRPO example, 30 steps each")
    spec = importlib.util.spec_from_file_location("make_tiny_sum_model", ROOT / "scripts" / "make_tiny_sum_model.py")
    example = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(example)
    made = example.save(str(home / "tiny-sum"))
    prompts = f"{made['prompts']}/sums.jsonl"
    out: dict[str, Any] = {"bench": "grpo", "steps": GRPO_STEPS, "skip": GRPO_SKIP,
                           "weight_sync_s": None, "weight_sync": "colocated: each worker samples with its own weights"}
    trl = _script_lines("bench_grpo_trl.py", "grpo_trl",
                        script_args=("--model", made["model"], "--prompts", prompts, "--steps", str(GRPO_STEPS),
                                     "--skip", str(GRPO_SKIP), "--out", str(home / "trl")))[0]
    out["trl"] = {k: trl.get(k) for k in ("steps_per_s", "generated_tokens_per_s", "wall_s", "status")}
    res = run_platform(home, "configs/tiny-grpo-cpu.yaml", "bench-grpo",
                       [f"model.pretrained={made['model']}", f"data.path={prompts}", f"train.max_steps={GRPO_STEPS}",
                        "tracking.log_every_steps=1", "resilience.checkpoint_every_steps=0",
                        "train.grpo.samples_every_steps=0", *args.platform_set], args.timeout)
    run_id = res["summary"]["mlflow_run_id"]
    stamps = {st: ts / 1000.0 for st, _, ts in metric_history(home, run_id, "reward")}
    lengths = {st: v for st, v, _ in metric_history(home, run_id, "completions/mean_length")}
    seconds = stamps[GRPO_STEPS] - stamps[GRPO_SKIP]
    tokens = sum(lengths[st] for st in range(GRPO_SKIP + 1, GRPO_STEPS + 1)) * res["summary"]["global_batch_size"]
    rollout = [v for st, v, _ in metric_history(home, run_id, "rollout/tokens_per_s") if st > GRPO_SKIP]
    out["rayspeed"] = {"steps_per_s": _r((GRPO_STEPS - GRPO_SKIP) / seconds, 3),
                       "generated_tokens_per_s": _r(tokens / seconds, 1),
                       "rollout_tokens_per_s": _r(_median(rollout), 1), "wall_s": _r(res["wall_s"], 1),
                       "workers": res["summary"]["world_size"]}
    if out["trl"].get("steps_per_s"):
        out["steps_per_s_ratio"] = _r(out["rayspeed"]["steps_per_s"] / out["trl"]["steps_per_s"], 3)
    return out


def bench_gpu(args) -> list[dict[str, Any]]:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        return [{"bench": "gpu", "status": "skipped",
                 "reason": "no CUDA device here; run scripts/bench_gpu.py on an H200"}]
    proc = subprocess.run([PY, str(ROOT / "scripts" / "bench_gpu.py")], cwd=str(ROOT), stdout=subprocess.PIPE,
                          text=True)
    lines = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    lines = lines or [{"bench": "gpu", "status": "failed", "rc": proc.returncode}]
    return lines + _script_lines("bench_attention_kernels.py", "attention_kernels")  # sdpa against flex


ADAPTER_MODEL = ["model.hidden_size=512", "model.num_layers=8", "model.num_heads=8", "model.num_kv_heads=4",
                 "model.ffn_hidden_size=1408", "model.seq_len=256", "train.global_batch_size=8", "train.max_steps=40",
                 "train.eval_every_steps=0", "parallel.zero_stage=2", "tracking.log_every_steps=5",
                 "resilience.checkpoint_every_steps=0", "tracking.loss_landscape=false", "health.preflight=false"]


def bench_adapters(args, home: Path) -> dict[str, Any]:
    """The same model (512 wide, 8 layers, 23.7M parameters; seq 256, batch 8, one CPU worker, ZeRO-2, fp32)
    fine-tuned in full and with LoRA (rank 16, all linear layers) one after the other: the median step time after
    warm-up and the model-state bytes per rank each run's engine reports (weights, master weights, optimizer
    states; DeepSpeed's ZeRO-2 keeps fp32 gradients in its partitions besides)."""
    _note("adapters: full fine-tune vs LoRA rank 16 (all linear layers), same model, one CPU worker")
    out: dict[str, Any] = {"bench": "adapters", "config": args.config, "model": ADAPTER_MODEL[:6]}
    for kind, extra in (("full", []), ("lora", ["model.adapter.type=lora", "model.adapter.rank=16"])):
        res = run_platform(home, args.config, f"bench-adapters-{kind}", [*ADAPTER_MODEL, *extra], args.timeout,
                           ["--launcher", "local"])
        times = [v for step, v, _ in res.get("step_times", []) if step > 10]
        out[f"{kind}_step_s"] = _r(_median(times))
        states = res["summary"].get("model_state_bytes") or {}
        out[f"{kind}_model_state_bytes"] = states
        out[f"{kind}_model_state_bytes_total"] = sum(states.values()) if states else None
        out[f"{kind}_final_loss"] = _r(res["summary"].get("final_loss"))
    if out.get("full_step_s") and out.get("lora_step_s"):
        out["lora_step_time_ratio"] = _r(out["lora_step_s"] / out["full_step_s"], 3)
    if out.get("full_model_state_bytes_total") and out.get("lora_model_state_bytes_total"):
        out["lora_model_state_ratio"] = _r(out["lora_model_state_bytes_total"] / out["full_model_state_bytes_total"], 3)
    return out


def bench_checkpoint(args) -> list[dict[str, Any]]:
    _note("checkpoint: sync vs async save of a ~300M-parameter model (scripts/bench_checkpoint.py)")
    proc = subprocess.run([PY, str(ROOT / "scripts" / "bench_checkpoint.py")], cwd=str(ROOT), stdout=subprocess.PIPE,
                          text=True)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return lines or [{"bench": "checkpoint", "status": "failed", "rc": proc.returncode}]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench.py", description="rayspeed benchmarks: one JSON line each")
    ap.add_argument("--config", default="configs/tiny-cpu.yaml")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each CPU run (medians are quoted)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--log-every", type=int, default=10, help="steps per timing window")
    ap.add_argument("--skip-windows", type=int, default=3, help="warm-up windows left out of the median")
    ap.add_argument("--zero", default="auto", help="zero_stage values to run, comma-separated (e.g. auto,2); the "
                    "first is the headline, the others are reported as zero<N> in the same line")
    ap.add_argument("--platform-set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra --set for the platform's CPU runs (experiments: what a setting costs)")
    ap.add_argument("--only", default="cpu,resilience,startup,planner,gpu,checkpoint,adapters,pipeline_memory,"
                    "microbatch_memory,context_parallel,moe,dpo,grpo",
                    help="comma-separated: cpu, resilience, startup, planner, gpu, checkpoint, adapters, "
                    "pipeline_memory, microbatch_memory, context_parallel, moe, dpo, grpo, "
                    "plan_accuracy, activation_memory, pipeline_overhead (the last three "
                    "not in the default)")
    ap.add_argument("--record-memory", action="store_true",
                    help=f"write the memory lines to {MEASURED_MEMORY.relative_to(ROOT)} (read by the planner's tests)")
    ap.add_argument("--home", default=None, help="scratch RAYSPEED_HOME (default: a new temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (logs, mlflow.db, runs)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for any one run")
    args = ap.parse_args(argv)
    args.tag = time.strftime("%Y%m%d%H%M%S")
    only = {s.strip() for s in args.only.split(",")}
    home = Path(args.home).resolve() if args.home else Path(tempfile.mkdtemp(prefix="rayspeed-bench-"))
    home.mkdir(parents=True, exist_ok=True)
    stamp = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
             "host": {"cpus": os.cpu_count(), "machine": _platform.machine(), "python": _platform.python_version()}}
    rc = 0
    try:
        lines: list[dict] = []
        if "planner" in only:
            lines.append(bench_planner(args))
        if "startup" in only:
            lines.append(bench_startup(args, home))
        cpu = bench_cpu(args, home) if "cpu" in only else None
        resil = bench_resilience(args, home) if "resilience" in only else None
        if cpu is not None:
            if resil is not None:
                cpu["recovery_s"], cpu["checkpoint_stall_s"] = resil["recovery_s"], resil["checkpoint_stall_s"]
            lines.insert(0, cpu)
        if resil is not None:
            lines.insert(1 if cpu is not None else 0, resil)
        if "plan_accuracy" in only:
            lines.append(bench_plan_accuracy(args, home))
        if "activation_memory" in only:
            lines += bench_activation_memory(args)
        if "pipeline_overhead" in only:
            lines += bench_pipeline_overhead(args)
        if "pipeline_memory" in only:
            lines += bench_pipeline_memory(args)
        if "microbatch_memory" in only:
            lines += bench_microbatch_memory(args)
        if args.record_memory:
            record_memory(lines, stamp)
        if "context_parallel" in only:
            lines += bench_context_parallel(args)
        if "moe" in only:
            lines += bench_moe(args)
        if "dpo" in only:
            lines += bench_dpo(args)
        if "grpo" in only:
            lines.append(bench_grpo(args, home))
        if "gpu" in only:
            lines += bench_gpu(args)
        if "checkpoint" in only:
            lines += bench_checkpoint(args)
        if "adapters" in only:
            lines.append(bench_adapters(args, home))
        for line in lines:
            _emit({**line, **stamp})
    except Exception as e:  # one clear line, not a traceback
        _note(f"failed: {type(e).__name__}: {e}")
        rc = 1
    finally:
        if args.keep or rc:
            _note(f"scratch folder kept: {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
