"""One-GPU benchmark: the platform's worker loop against bare PyTorch (eager and torch.compile), same model.

    python3 scripts/bench_gpu.py                       # on an H200: ~1.1B Llama-style model, seq 2048, bf16
    python3 scripts/bench_gpu.py --device cpu          # dry run on CPU: tiny model, fp32, every code path

Modes, each in its own process (clean peak memory, no state shared), in this order so the ones that matter
most run first if --budget-s runs short:
  compile          bare PyTorch: model.compile(), fp32 weights + bf16 autocast, fused AdamW, clip, TF32 on
  platform         jobs/train.py --launcher local (the platform's worker loop, DeepSpeed, planner layout) with
                   the model compiled before deepspeed.initialize (RAYSPEED_COMPILE=1)
  eager            bare PyTorch as `compile` without the compile
  platform_eager   the platform with RAYSPEED_COMPILE=0
  platform_lora    `platform` with LoRA (model.adapter: rank 16, every linear layer): the same model's adapter
                   fine-tune beside its full one (step_s, peak_gib, the engine's model-state bytes)
Both sides read the loss on the host only at window ends (every --window steps) and time each window;
step_s is the median window after --warmup steps. Same Transformer (rayspeed.model.transformer), same
token file, same batch (micro = global = --batch, no accumulation), no activation checkpointing.

Model "1b": TinyLlama-1.1B's shape (h 2048, 22 layers, 32 heads, 4 kv heads, SwiGLU 5632, vocab 32000,
untied). MFU = tokens/s x (6N + 12 L h s) / 989e12 with rayspeed's one definition (ModelShape.flops_per_token,
PaLM's: N = non-embedding parameters, the input embedding of an untied model being a lookup), the same as the
training metric perf/mfu and the planner. The token file holds ids in [0, 256) so the byte tokenizer accepts it;
the model's 32000-way head sets the cost, not the ids.

One JSON line per mode ({"bench": "gpu", "mode": ...}) and a closing {"bench": "gpu_summary"} line on stdout;
also appended to --out (default $OUT/bench_gpu.jsonl when $OUT is set). Needs torch; the platform modes
also need deepspeed and pyyaml (mlflow optional: without it the step times come from the worker's log).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
try:
    import rayspeed  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "platform"))

PEAK_TFLOPS = 989.0  # H200 SXM dense bf16, datasheet
MODES = ("compile", "platform", "eager", "platform_eager", "platform_lora")
SIZES = {
    "1b": dict(hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4, ffn_hidden_size=5632, vocab_size=32000,
               tie_embeddings=False),
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=256, vocab_size=512,
                 tie_embeddings=False),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="scripts/bench_gpu.py", description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--size", choices=tuple(SIZES), default=None, help="default: 1b on cuda, tiny on cpu")
    ap.add_argument("--seq", type=int, default=None, help="default: 2048 on cuda, 128 on cpu")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step; default: 8 on cuda, 4 on cpu")
    ap.add_argument("--warmup", type=int, default=8, help="steps left out (the compile happens in the first)")
    ap.add_argument("--steps", type=int, default=16, help="timed steps")
    ap.add_argument("--window", type=int, default=4, help="steps per timing window (one host sync each)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--budget-s", type=float, default=540.0, help="wall budget for all modes; later modes are skipped")
    ap.add_argument("--out", default=None)
    ap.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one, deleted)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    cpu = a.device == "cpu"
    a.size = a.size or ("tiny" if cpu else "1b")
    a.seq = a.seq or (128 if cpu else 2048)
    a.batch = a.batch or (4 if cpu else 8)
    a.dtype = "fp32" if cpu else "bf16"
    if a.warmup % a.window or a.steps % a.window:
        ap.error("--warmup and --steps must be multiples of --window")
    return a


# ---------------------------------------------------------------- shared pieces


def model_cfg(a) -> dict[str, Any]:
    return {**SIZES[a.size], "seq_len": a.seq}


def flops_per_token(a, lora: bool = False) -> tuple[int, float]:
    """(parameters, model FLOPs per token): rayspeed.config.shape.ModelShape's, the one definition of MFU (PaLM's
    6 N non-embedding + 12 L h s) that perf/mfu and the planner use; with LoRA the frozen projections' weight
    gradients left out and the adapters' FLOPs added (rayspeed.config.adapter.flops_per_token)."""
    from types import SimpleNamespace

    from rayspeed.config import adapter
    from rayspeed.config.shape import ModelShape

    shape = ModelShape.from_config(SimpleNamespace(**model_cfg(a)))
    lora_section = SimpleNamespace(type="lora", rank=16, targets=["all"], dora=False)
    return shape.params, adapter.flops_per_token(shape, lora_section if lora else None)


def token_file(workdir: Path, a) -> Path:
    """Random ids in [0, 256) (uint16), enough for every step plus the validation split."""
    import numpy as np

    per_step = a.batch * (a.seq + 1)
    val_fraction = 0.05
    need = max(int((a.warmup + a.steps + 2) * per_step / (1 - val_fraction)), int(2 * per_step / val_fraction))
    path = workdir / "tokens.bin"
    if not path.exists() or path.stat().st_size != 2 * need:
        rng = np.random.default_rng(1234)
        rng.integers(0, 256, size=need, dtype=np.uint16).astype("<u2").tofile(path)
    return path


def steady(windows: list[float], skip: int) -> Optional[float]:
    kept = windows[skip:] if len(windows) > skip else windows
    return statistics.median(kept) if kept else None


def result_line(a, mode: str, windows: list[float], peak_gib: Optional[float], first_step_s: Optional[float],
                extra: dict[str, Any]) -> dict[str, Any]:
    import torch

    n_total, fpt = flops_per_token(a, lora=mode == "platform_lora")
    step = steady(windows, a.warmup // a.window)
    tokens = a.batch * a.seq
    tps = tokens / step if step else None
    dev = torch.cuda.get_device_name(0) if a.device == "cuda" and torch.cuda.is_available() else "cpu"
    return {
        "bench": "gpu", "mode": mode, "device": dev, "model": a.size, "params": n_total, "seq_len": a.seq,
        "batch": a.batch, "tokens_per_step": tokens, "dtype": a.dtype,
        "step_s": None if step is None else round(step, 5),
        "tokens_per_s": None if tps is None else round(tps, 1),
        "mfu": None if tps is None else round(tps * fpt / (PEAK_TFLOPS * 1e12), 4),
        "flops_per_token": fpt, "peak_gib": None if peak_gib is None else round(peak_gib, 2),
        "first_step_s": None if first_step_s is None else round(first_step_s, 1),
        "window_step_s": [round(w, 5) for w in windows], "torch": torch.__version__, **extra,
    }


# ---------------------------------------------------------------- bare PyTorch


def worker_bare(a, workdir: Path, compiled: bool) -> dict[str, Any]:
    from contextlib import nullcontext
    from types import SimpleNamespace

    import numpy as np
    import torch

    from rayspeed.model.transformer import Transformer

    cuda = a.device == "cuda"
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(1234)
    model = Transformer(SimpleNamespace(**model_cfg(a)), seed=1234).to(dev)
    if compiled:
        model.compile()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    tokens = np.fromfile(token_file(workdir, a), dtype="<u2").astype(np.int64)
    n_seq = (len(tokens) - 1) // (a.seq + 1)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if a.dtype == "bf16" else nullcontext()

    def batch(step: int):
        idx = (np.arange(a.batch) + step * a.batch) % n_seq
        w = np.stack([tokens[i * (a.seq + 1):(i + 1) * (a.seq + 1)] for i in idx])
        t = torch.from_numpy(w)
        if cuda:
            t = t.pin_memory().to(dev, non_blocking=True)
        return t[:, :-1], t[:, 1:]

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    windows: list[float] = []
    loss_acc = torch.zeros((), device=dev)
    t_first = None
    t_start = time.perf_counter()
    t0 = time.perf_counter()
    total = a.warmup + a.steps
    for step in range(total):
        x, y = batch(step)
        with amp:
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True if cuda else None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_acc += loss.detach().float()
        if step == 0:
            float(loss_acc)  # the first step (and its compile) finished
            t_first = time.perf_counter() - t_start
        if (step + 1) % a.window == 0:
            float(loss_acc)  # the window's one host sync, as the platform's log step
            windows.append((time.perf_counter() - t0) / a.window)
            loss_acc.zero_()
            t0 = time.perf_counter()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return result_line(a, "compile" if compiled else "eager", windows, peak, t_first,
                       {"optimizer": "torch AdamW fused",
                        "weights": "fp32 + autocast bf16" if a.dtype == "bf16" else "fp32"})


# ---------------------------------------------------------------- the platform


class _StepLog(logging.Handler):
    """Catches the worker's log-step records ("step %d/%d loss ... %.3f s/step"): the step times when there is
    no MLflow to read them from."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.windows: list[tuple[int, float]] = []
        self.first: Optional[float] = None

    def emit(self, record: logging.LogRecord) -> None:
        msg = str(record.msg)
        if msg.startswith("step %d/%d loss") and record.args:
            self.windows.append((int(record.args[0]), float(record.args[-1])))
        elif msg.startswith("first step done") and record.args:
            self.first = float(record.args[0])


def job_yaml(a, workdir: Path, name: str, lora: bool = False) -> Path:
    import yaml

    storage = workdir / "runs"
    shm = Path("/dev/shm")
    if a.device == "cuda" and shm.is_dir() and shutil.disk_usage(shm).free > 40 * 2**30:
        # The final checkpoint (~15 GB at 1.1B) goes to RAM, not the 64 GiB disk.
        storage = shm / f"rayspeed-bench-gpu-{os.environ.get('RAYSPEED_BENCH_GPU_ID', os.getpid())}"
    job = {
        "name": name,
        "model": model_cfg(a),
        "data": {"source": "files", "path": str(token_file(workdir, a)), "tokenizer": "bytes", "val_fraction": 0.05},
        "train": {"global_batch_size": a.batch, "max_steps": a.warmup + a.steps, "lr": 3.0e-4, "min_lr": 3.0e-5,
                  "warmup_steps": 2, "precision": a.dtype, "eval_every_steps": 0, "eval_batches": 1},
        "parallel": {"dp": 1, "tp": 1, "pp": 1, "micro_batch_size": a.batch, "grad_accum": 1,
                     "activation_checkpointing": "none"},
        "cluster": {"num_workers": 1, "use_gpu": a.device == "cuda"},
        "resilience": {"checkpoint_every_steps": 0},
        "tracking": {"log_every_steps": a.window},
        "storage": {"path": str(storage)},
        "health": {"preflight": False},
    }
    if lora:
        job["model"]["adapter"] = {"type": "lora", "rank": 16, "alpha": 32, "targets": ["all"]}
    if a.device == "cuda":
        job["cluster"]["gpu"] = "h200"
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def worker_platform(a, workdir: Path, compiled: bool, lora: bool = False) -> dict[str, Any]:
    import torch

    mode = "platform_lora" if lora else "platform" if compiled else "platform_eager"
    os.environ["RAYSPEED_COMPILE"] = "1" if compiled else "0"
    home = workdir / f"home-{mode}"
    home.mkdir(parents=True, exist_ok=True)
    os.environ["RAYSPEED_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    cfg_path = job_yaml(a, workdir, f"bench-gpu-{mode}", lora)
    catcher = _StepLog()
    logging.getLogger("rayspeed.worker").addHandler(catcher)
    from rayspeed.cli import main as cli

    if a.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    rc = cli(["train", "--config", str(cfg_path), "--launcher", "local"])
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"jobs/train.py --launcher local exited {rc}")
    peak = torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else None
    windows = [v for _, v in sorted(catcher.windows)]
    source = "worker log"
    summary = {}
    try:  # the interface's perf/step_time_s, when MLflow is installed
        import yaml

        job = yaml.safe_load(cfg_path.read_text())
        summary = json.loads((Path(job["storage"]["path"]) / job["name"] / "summary.json").read_text())
        if summary.get("mlflow_run_id"):
            from mlflow.tracking import MlflowClient

            hist = MlflowClient(f"sqlite:///{home / 'mlflow.db'}").get_metric_history(summary["mlflow_run_id"],
                                                                                       "perf/step_time_s")
            if hist:
                windows, source = [m.value for m in sorted(hist, key=lambda m: m.step)], "mlflow perf/step_time_s"
    except Exception:
        pass
    plan = {}
    try:
        from rayspeed.config.load import load
        from rayspeed.planner import resolve

        cfg, _ = resolve(load(str(cfg_path)), world_size=1)
        plan = {"zero_stage": cfg.parallel.zero_stage, "precision": cfg.train.precision}
    except Exception:
        pass
    return result_line(a, mode, windows, peak, catcher.first, {
        "launcher": "local", "step_times_from": source, "run_wall_s": round(wall, 1), **plan,
        "final_loss": summary.get("final_loss"), "model_state_bytes": summary.get("model_state_bytes"),
    })


# ---------------------------------------------------------------- orchestration


def run_worker(a, workdir: Path) -> int:
    mode = a.worker
    if mode in ("eager", "compile"):
        line = worker_bare(a, workdir, compiled=mode == "compile")
    elif mode in ("platform", "platform_eager", "platform_lora"):
        line = worker_platform(a, workdir, compiled=mode != "platform_eager", lora=mode == "platform_lora")
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(line), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.worker:
        return run_worker(a, Path(a.workdir))
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}; choose from {MODES}")
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: use --device cpu for a dry run")
    out = Path(a.out) if a.out else (Path(os.environ["OUT"]) / "bench_gpu.jsonl" if os.environ.get("OUT") else None)
    workdir = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="rayspeed-bench-gpu-"))
    workdir.mkdir(parents=True, exist_ok=True)
    stamp = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    t_end = time.monotonic() + a.budget_s
    lines: list[dict[str, Any]] = []

    def emit(obj: dict[str, Any]) -> None:
        obj = {**obj, **stamp}
        lines.append(obj)
        print(json.dumps(obj), flush=True)
        if out is not None:
            with open(out, "a") as fh:
                fh.write(json.dumps(obj) + "\n")

    try:
        for mode in modes:
            left = t_end - time.monotonic()
            if left < 60:
                emit({"bench": "gpu", "mode": mode, "status": "skipped", "reason": f"budget: {left:.0f} s left"})
                continue
            cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", mode, "--workdir", str(workdir)]
            log_path = workdir / f"{mode}.log"
            t0 = time.monotonic()
            try:
                with open(log_path, "w") as log:
                    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, timeout=left,
                                          cwd=str(ROOT), env=dict(os.environ, PYTHONUNBUFFERED="1",
                                                                  RAYSPEED_BENCH_GPU_ID=str(os.getpid())))
                found = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"bench"')]
                if proc.returncode == 0 and found:
                    emit({**found[-1], "status": "ok", "process_s": round(time.monotonic() - t0, 1)})
                else:
                    tail = log_path.read_text()[-1500:]
                    emit({"bench": "gpu", "mode": mode, "status": "failed", "rc": proc.returncode, "stderr_tail": tail})
            except subprocess.TimeoutExpired:
                emit({"bench": "gpu", "mode": mode, "status": "timeout", "after_s": round(time.monotonic() - t0, 1)})
        by = {l["mode"]: l for l in lines if l.get("status") == "ok"}

        def ratio(x: str, y: str) -> Optional[float]:
            if x in by and y in by and by[x].get("step_s") and by[y].get("step_s"):
                return round(by[x]["step_s"] / by[y]["step_s"], 4)
            return None

        emit({"bench": "gpu_summary", "device": next((l["device"] for l in by.values()), None),
              "step_s": {m: by[m]["step_s"] for m in by}, "mfu": {m: by[m]["mfu"] for m in by},
              "peak_gib": {m: by[m]["peak_gib"] for m in by},
              # < 1: the platform is faster than that bare loop
              "platform_vs_compile": ratio("platform", "compile"), "platform_vs_eager": ratio("platform", "eager"),
              "platform_eager_vs_eager": ratio("platform_eager", "eager"),
              "lora_vs_platform": ratio("platform_lora", "platform")})
    finally:
        if not a.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(Path("/dev/shm") / f"rayspeed-bench-gpu-{os.getpid()}", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
