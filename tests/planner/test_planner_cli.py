"""`rayspeed plan`: output forms, --layouts, exit codes, and no heavy imports."""

import json
import os
import subprocess
import sys

from rayspeed.cli import main as cli


def main(argv):
    return cli(["plan", *argv])

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny-cpu.yaml")
L70B = os.path.join(ROOT, "configs", "llama-70b-64xh100.yaml")
PLAN_KEYS = {"dp", "tp", "pp", "zero_stage", "micro_batch_size", "grad_accum", "sequence_parallel",
             "activation_checkpointing", "fits", "memory_gib_per_gpu", "memory_breakdown_gib", "step_time_s",
             "tokens_per_s_per_gpu", "mfu"}


def test_json_output(capsys):
    assert main([L70B, "--json", "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"plan", "alternatives", "explain"} <= set(out)
    assert PLAN_KEYS <= set(out["plan"]) and out["plan"]["fits"]
    assert 1 <= len(out["alternatives"]) <= 3 and all(PLAN_KEYS <= set(a) for a in out["alternatives"])
    assert "chosen layout" in out["explain"]


def test_explain_and_summary(capsys):
    assert main([L70B, "--explain"]) == 0
    text = capsys.readouterr().out
    assert "runner-up layouts" in text and "memory per GPU" in text and "field guide rules" in text
    # MFU says what it counts and whether the time behind it is calibrated
    assert "time per step (predicted, uncalibrated)" in text and "attention counted in full" in text
    assert main([TINY, "--world-size", "4"]) == 0
    assert "dp 4 x tp 1 x pp 1" in capsys.readouterr().out


def test_set_overrides(capsys):
    assert main([TINY, "--json", "--set", "cluster.num_workers=4", "--set", "parallel.zero_stage=auto"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["dp"] == 4


def test_layouts_one_line_per_input_in_order(tmp_path, capsys):
    rows = [
        {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 0, "micro_batch_size": 8, "grad_accum": 1,
         "sequence_parallel": False, "activation_checkpointing": "none"},
        {"dp": 1, "tp": 2, "pp": 1, "zero_stage": 1, "micro_batch_size": 4, "grad_accum": 4,
         "sequence_parallel": True, "activation_checkpointing": "full"},
        {"dp": 5, "tp": 1, "pp": 1, "zero_stage": 0, "micro_batch_size": 1, "grad_accum": 1,
         "sequence_parallel": False, "activation_checkpointing": "none"},
    ]
    f = tmp_path / "layouts.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main([TINY, "--layouts", str(f)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3
    out = [json.loads(line) for line in lines]
    for r, o in zip(rows, out):
        assert PLAN_KEYS <= set(o)
        assert all(o[k] == v for k, v in r.items())
    assert out[0]["fits"] and out[1]["fits"] and not out[2]["fits"] and out[2]["reason"]


def test_config_error_exit_2_no_traceback(capsys):
    assert main([TINY, "--set", "cluster.num_workers=3", "--set", "parallel.micro_batch_size=2"]) == 2
    err = capsys.readouterr().err
    assert "train.global_batch_size (16) is not divisible" in err and "Traceback" not in err
    assert main([os.path.join(ROOT, "configs", "missing.yaml")]) == 2
    assert main([TINY, "--layouts", "/nonexistent.jsonl"]) == 2


def test_no_torch_ray_deepspeed_import():
    code = ("import sys, io, contextlib\n"
            "from rayspeed.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    assert main(['plan', {L70B!r}, '--json']) == 0\n"
            "heavy = sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('torch', 'ray', 'deepspeed', 'mlflow', 'numpy'))\n"
            "print(heavy)\n")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "platform"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"


def test_plan_runs_the_health_key_checks_too(capsys):
    """Every command loads the job through the same checks (before, `rayspeed plan` skipped the health section
    and the cluster.env lint, so a job it planned could still fail at launch)."""
    assert main([TINY, "--set", "health.grad_norm_spike_factor=1"]) == 2
    assert "health.grad_norm_spike_factor" in capsys.readouterr().err
    assert main([TINY, "--set", 'cluster.env={NCCL_SOCKET_TIMEOUT: "600"}']) == 2
    err = capsys.readouterr().err
    assert "cluster.env.NCCL_SOCKET_TIMEOUT" in err and "collective_timeout_s" in err
