"""Hardware profiles (precedence, the GEMM table, errors), the predicted-vs-measured metrics, the fit of the
efficiency factors with its leave-one-out error, and the profile built from a calibration report."""

import json
import os
import subprocess
import sys

import pytest

from rayspeed.cli import main as _cli
from rayspeed.config.load import load
from rayspeed.errors import ConfigError
from rayspeed.planner import plan_job
from rayspeed.planner.calibfit import fit, fit_factors, leave_one_out
from rayspeed.planner.feedback import plan_metrics, steady_step_time
from rayspeed.planner.search import build_ctx


def main(argv):
    return _cli(["plan", *argv])


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny-cpu.yaml")
L70B = os.path.join(ROOT, "configs", "llama-70b-64xh100.yaml")


def _profile(tmp_path, **kw):
    data = {"kind": "rayspeed-hardware-profile", "version": 1, "device": "cpu", "gpu": "cpu", "nodes": 1, "ranks": 2,
            "measured_at": "2026-11-30T12:00:00+00:00", "hardware": {}, "gemm": [],
            "efficiency": {"compute": 1.0, "comm": 1.0, "overhead": 1.0}}
    data.update(kw)
    p = tmp_path / "profile.json"
    p.write_text(json.dumps(data))
    return str(p)


def test_profile_beats_job_overrides_beats_table(tmp_path):
    cfg = load(TINY, ["cluster.hardware={hbm_gbps: 4.0, intra_latency_us: 99}"])
    assert build_ctx(cfg).hw.hbm_gbps == 4.0
    prof = _profile(tmp_path, hardware={"hbm_gbps": 12.5})
    ctx = build_ctx(cfg, profile=prof)
    assert ctx.hw.hbm_gbps == 12.5  # profile > cluster.hardware
    assert ctx.hw.intra_latency_us == 99  # what the profile does not set stays the job's override
    assert build_ctx(load(TINY, [f"cluster.profile={prof}"])).profile == prof  # the job key


def test_gemm_table_drives_compute(tmp_path):
    slow = _profile(tmp_path, gemm=[[1024, 64, 64, 1e9], [1024, 64, 256, 1e9], [1024, 256, 64, 1e9],
                                    [1024, 64, 256, 1e9]])
    base = plan_job(load(TINY)).best["time_breakdown_s"]["compute_s"]
    with_table = plan_job(load(TINY), profile=slow).best["time_breakdown_s"]["compute_s"]
    assert with_table > 2 * base  # 1 GFLOP/s measured: far below the table's CPU figure


def test_profile_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError) as ei:
        build_ctx(load(TINY, ["cluster.profile=/nonexistent/p.json"]))
    assert "cluster.profile" in ei.value.render() and "rayspeed calibrate" in ei.value.render()
    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": "something else"}')
    with pytest.raises(ConfigError):
        build_ctx(load(TINY), profile=str(bad))
    gpu_prof = _profile(tmp_path, gpu="h100-sxm-80gb", device="NVIDIA H100 80GB HBM3")
    with pytest.raises(ConfigError) as ei:
        build_ctx(load(TINY), profile=gpu_prof)
    assert "measured on h100-sxm-80gb" in ei.value.render()
    assert main([TINY, "--profile", "/nonexistent/p.json"]) == 2


def test_plan_cli_with_profile_explains_it(tmp_path, capsys):
    prof = _profile(tmp_path, fit={"experiment": "e", "runs": 4, "loo_median_abs_error": 0.07})
    assert main([TINY, "--profile", prof, "--explain"]) == 0
    text = capsys.readouterr().out
    assert f"calibrated profile {prof}" in text and "7.0%" in text
    assert f"time per step (predicted, calibrated profile {prof})" in text
    assert main([TINY, "--profile", prof, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["profile"]["path"] == prof and plan["profile"]["model_error"] == 0.07


def test_steady_state_median_skips_warmup():
    windows = [(5, 5, 9.0), (10, 5, 3.0), (15, 5, 1.0), (20, 5, 1.2), (25, 5, 1.1), (30, 5, 0.9)]
    assert steady_step_time(windows) == pytest.approx(1.05)
    assert steady_step_time(windows[:2]) is None
    m = plan_metrics({"step_time_s": 1.0, "memory_gib_per_gpu": 10.0}, windows, measured_memory_gib=8.0)
    assert m["plan/predicted_step_time_s"] == 1.0 and m["plan/measured_step_time_s"] == pytest.approx(1.05)
    assert m["plan/predicted_memory_gib"] == 10.0 and m["plan/measured_memory_gib"] == 8.0
    assert "plan/measured_memory_gib" not in plan_metrics({"step_time_s": 1.0}, windows)


def test_fit_recovers_factors_and_reports_held_out_error():
    truth = (1.3, 1.5, 0.8)
    groups = [(1.0, 0.1, 0.2), (0.5, 0.4, 0.1), (2.0, 0.05, 0.3), (0.3, 0.3, 0.3), (1.2, 0.6, 0.05), (0.8, 0.2, 0.5),
              (0.6, 0.5, 0.2), (1.5, 0.2, 0.4)]
    rows = [(g, sum(a * b for a, b in zip(g, truth))) for g in groups]
    assert fit_factors(rows, ridge=1e-6) == pytest.approx(truth, rel=1e-3)  # noiseless: exact without the prior
    loo = sorted(abs(e) for e in leave_one_out(rows))
    assert loo[len(loo) // 2] < 0.12  # held out, with the default prior pulling towards 1
    out = fit([{"run_id": str(i), "groups": g, "measured": m} for i, (g, m) in enumerate(rows)], {"kind": "x"}, "exp")
    f = out["fit"]
    assert f["runs"] == 8 and f["loo_median_abs_error"] < f["unfitted_median_abs_error"]
    assert f["in_sample_median_abs_error"] < f["unfitted_median_abs_error"] and out["efficiency"]["comm"] > 1.1
    with pytest.raises(ConfigError):
        fit([], {}, "exp")


def test_build_profile_from_a_calibration_report():
    from rayspeed.health.calibrate import build_profile

    ctx = build_ctx(load(TINY))
    rows = [{"bytes": b, "time_us": 300 + b / 1e9 * 1e6, "busbw_gbps": 1.0, "ok": True}
            for b in (1024, 65536, 1 << 20, 16 << 20)]
    rep = {"ranks": [{"copy_gbps": 10.0}, {"copy_gbps": 12.0}], "cluster": {"nodes_used": 1}, "backend": "gloo",
           "allreduce": rows, "allgather": rows, "per_node": {}, "seconds": 30.0}
    eng = {"2": {"depths": [1, 3], "fwd_s": [0.002, 0.004], "bwd_s": [0.005, 0.009], "step_s": [0.010, 0.012]},
           "0": {"depths": [1, 3], "fwd_s": [0.001, 0.002], "bwd_s": [0.001, 0.002], "step_s": [0.001, 0.001]}}
    cal = [{"gemm": [[128, 64, 64, 5e10]], "op_overhead_us": 4.0, "attention_flops": 1e10, "reducescatter": [],
            "engine": eng} for _ in range(2)]
    prof = build_profile(rep, cal, ctx, zero=2)
    hw = prof["hardware"]
    assert hw["hbm_gbps"] == 11.0 and hw["kernel_overhead_us"] == 4.0
    assert hw["host_fwd_layer_us"] == pytest.approx(1000.0) and hw["host_bwd_layer_us"] == pytest.approx(2000.0)
    assert hw["host_fixed_mb_us"] == pytest.approx(1000.0 + 3000.0)
    assert hw["engine_step_s"] == pytest.approx(0.009 + 0.001 * ctx.shape.num_layers)
    # t = 300 us + 2 (n-1)/n bytes / busbw with n = 2: busbw = 1 GB/s
    assert (hw["intra_latency_us"] == pytest.approx(300, rel=0.01)
            and hw["intra_node_gbps"] == pytest.approx(1.0, rel=0.01))
    assert prof["kind"] == "rayspeed-hardware-profile" and prof["gemm"] == [[128, 64, 64, 5e10]]
    ctx2 = build_ctx(load(TINY), profile=prof)
    assert ctx2.hw.host_fwd_layer_us == pytest.approx(1000.0)
    assert dict((z, f) for z, f, *_ in ctx2.engine_by_zero) == {0: pytest.approx(500.0), 2: pytest.approx(1000.0)}
    from rayspeed.config.layout import Layout
    from rayspeed.planner.timing import engine_overheads
    assert engine_overheads(ctx2, Layout(2, 1, 1, 0, 8, 1))[0] == pytest.approx(500e-6)  # per ZeRO stage


def test_planner_and_config_stay_free_of_heavy_imports(tmp_path):
    prof = _profile(tmp_path)
    code = ("import sys, io, contextlib\n"
            "from rayspeed.cli import main\n"
            "import rayspeed.planner.calibfit, rayspeed.planner.feedback, rayspeed.compat\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    assert main(['plan', {TINY!r}, '--json', '--profile', {prof!r}]) == 0\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'ray', 'deepspeed', 'mlflow', 'numpy')))\n")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "platform"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"
