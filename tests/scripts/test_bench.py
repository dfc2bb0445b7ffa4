"""Smoke tests for the benchmark scripts (scripts/bench.py, bare_ddp.py, bench_gpu.py): their pieces run and
print what `make bench` relies on. No timing is asserted: these machines are shared and noisy."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _load("bench")


@pytest.fixture(scope="module")
def bench_gpu():
    return _load("bench_gpu")


def test_steady_state_skips_warmup_windows(bench):
    assert bench.steady_state([9.0, 8.0, 1.0, 3.0, 2.0], skip=2) == 2.0
    assert bench.steady_state([5.0], skip=3) == 5.0  # too few windows: all of them
    assert bench.steady_state([], skip=1) is None


def test_cpu_split_and_idle_projection(bench):
    """Two workers at one core each, 10 steps/s, plus 0.1 core of background (fake samples, no process)."""
    tree = bench.TreeCPU.__new__(bench.TreeCPU)
    tree.samples = [(float(t), {"w1": 1.0 * t, "w2": 1.0 * t, "bg": 0.1 * t}) for t in range(5)]
    ends = [(10 * t, float(t)) for t in range(5)]
    c = bench.cpu_split(tree, ends, skip=1, workers=2)
    assert c["worker_cpu_s_per_step"] == pytest.approx(0.1)
    assert c["background_cores"] == pytest.approx(0.1)
    assert c["tree_cpu_s_per_step"] == pytest.approx(0.21)
    bare = {"worker_cpu_s_per_step": 0.1, "background_cores": 0.0}
    assert bench.projected_ratio(c, bare, cores=2) == pytest.approx(2 / 1.9)
    assert bench.cpu_split(tree, ends[:2], skip=1, workers=2) is None  # nothing after the warm-up


def test_first_step_time_sources(bench):
    res = {"summary": {}, "first_steps": [(1000.0, 4.0), (1100.0, 9.0)], "first_metric_at": None}
    assert bench.platform_first_step_at(res) == 1000.0  # arrival of the worker's line
    assert bench.platform_first_step_at(res, which=1) == 1100.0
    assert bench.platform_first_step_at(res, which=2) is None
    res["first_metric_at"] = 999.2
    assert bench.platform_first_step_at(res) == 999.2  # the MLflow stamp of the step-1 metrics
    assert bench.platform_first_step_at(res, which=1) == 1100.0
    res["summary"] = {"first_step_at": 990.5}
    assert bench.platform_first_step_at(res) == 990.5  # the summary's own field wins


def test_planner_line(bench):
    line = bench.bench_planner(SimpleNamespace())
    assert line["bench"] == "planner_512" and line["gpus"] == 512
    assert line["search_s"] > 0 and line["cli_s"] > 0
    p = line["plan"]
    assert p["dp"] * p["tp"] * p["pp"] == 512
    json.dumps(line)


def test_gpu_line_is_skipped_without_cuda(bench):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    (line,) = bench.bench_gpu(SimpleNamespace())
    assert line == {"bench": "gpu", "status": "skipped",
                    "reason": "no CUDA device here; run scripts/bench_gpu.py on an H200"}


def test_bare_ddp_two_steps(tmp_path):
    """The torchrun-style baseline: 2 processes, one thread each, same resolved job as the platform."""
    out = tmp_path / "bare.json"
    env = dict(os.environ, RAYSPEED_HOME=str(tmp_path))
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bare_ddp.py"), "--config", str(ROOT / "configs" / "tiny-cpu.yaml"),
         "--steps", "2", "--log-every", "1", "--json-out", str(out), "--cache-dir", str(tmp_path / "cache")],
        env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())["bare_ddp"]
    assert res["world_size"] == 2 and res["threads_per_process"] == 1
    assert (res["micro_batch_size"], res["grad_accum"], res["global_batch_size"], res["seq_len"]) == (8, 1, 16, 128)
    assert len(res["window_step_s"]) == 2 and all(w > 0 for w in res["window_step_s"])
    assert res["first_step_at"] >= res["started_at"]
    assert res["final_loss"] == res["final_loss"]  # not NaN


def test_gpu_script_sizes_and_mfu(bench_gpu):
    a = bench_gpu.parse_args([])
    assert (a.size, a.seq, a.batch, a.dtype) == ("1b", 2048, 8, "bf16")
    n_total, fpt = bench_gpu.flops_per_token(a)
    assert 1.0e9 < n_total < 1.2e9  # TinyLlama-1.1B's shape
    m = bench_gpu.SIZES["1b"]
    n_matmul = n_total - m["vocab_size"] * m["hidden_size"]
    assert fpt == 6 * n_matmul + 12 * m["num_layers"] * m["hidden_size"] * 2048
    c = bench_gpu.parse_args(["--device", "cpu"])
    assert (c.size, c.dtype) == ("tiny", "fp32")


def test_gpu_script_bare_loop_on_cpu(bench_gpu, tmp_path):
    """The bare eager worker at tiny size on CPU (what `--device cpu` dry-runs, minus the process)."""
    a = bench_gpu.parse_args(["--device", "cpu", "--warmup", "1", "--steps", "2", "--window", "1"])
    line = bench_gpu.worker_bare(a, tmp_path, compiled=False)
    assert line["mode"] == "eager" and line["device"] == "cpu"
    assert len(line["window_step_s"]) == 3 and line["step_s"] > 0 and line["tokens_per_s"] > 0
    json.dumps(line)


def test_compile_decision():
    from rayspeed.engine.transforms import compile_decision

    def cfg(compile=None, pp=1, tp=1, zero=1):
        train = SimpleNamespace() if compile is None else SimpleNamespace(compile=compile)
        return SimpleNamespace(train=train, parallel=SimpleNamespace(pp=pp, tp=tp, zero_stage=zero))

    old = os.environ.pop("RAYSPEED_COMPILE", None)
    try:
        assert compile_decision(cfg(), on_gpu=True)[0] is False  # no key: off
        assert compile_decision(cfg("auto"), on_gpu=True)[0] is True
        assert compile_decision(cfg("auto"), on_gpu=False)[0] is False
        assert compile_decision(cfg("auto", tp=2), on_gpu=True)[0] is False
        assert compile_decision(cfg(True), on_gpu=False)[0] is True
        assert compile_decision(cfg(True, pp=2), on_gpu=True)[0] is False
        assert compile_decision(cfg(True, zero=3), on_gpu=True)[0] is False
        os.environ["RAYSPEED_COMPILE"] = "1"
        assert compile_decision(cfg(False), on_gpu=False)[0] is True
        os.environ["RAYSPEED_COMPILE"] = "0"
        assert compile_decision(cfg("auto"), on_gpu=True)[0] is False
    finally:
        os.environ.pop("RAYSPEED_COMPILE", None)
        if old is not None:
            os.environ["RAYSPEED_COMPILE"] = old
