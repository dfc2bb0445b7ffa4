"""`rayspeed calibrate` for real: 2 CPU workers on a local Ray, gloo collectives, the profile written, recorded in
MLflow (experiment rayspeed-calibration, the profile as an artifact), and usable by `rayspeed plan --profile`."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_calibrate_writes_a_profile_the_planner_uses(tmp_path):
    out = tmp_path / "profile.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "platform"), RAYSPEED_HOME=str(tmp_path))
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run([sys.executable, "-m", "rayspeed", "calibrate", "--config",
                        os.path.join(ROOT, "configs", "tiny-cpu.yaml"), "--workers", "2", "--out", str(out)],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    prof = json.loads(out.read_text())
    assert prof["kind"] == "rayspeed-hardware-profile" and prof["ranks"] == 2 and prof["nodes"] == 1
    assert prof["device"] == "cpu" and prof["backend"] == "gloo" and prof["measured_at"]
    hw = prof["hardware"]
    for key in ("intra_node_gbps", "intra_latency_us", "hbm_gbps", "engine_step_s", "host_fwd_layer_us",
                "work_scale_fwd", "pipe_host_mb_us"):
        assert key in hw, key
    # DeepSpeed's pipeline engine measured on the two ranks (pp 2) at 2 and 8 micro-batches: its host time per
    # micro-batch beyond what the planner already charges a stage's micro-batch (0 when nothing is left over).
    pipe = [r for r in prof["host_probe"]["pipeline"] if r]
    assert len(pipe) == 2 and all(r["ms"] == [2, 8] and r["step_s"][1] > r["step_s"][0] for r in pipe), pipe
    assert hw["pipe_host_mb_us"] >= 0
    assert prof["gemm"] and set(prof["engine"]) == {"0", "1", "2", "3"} and len(prof["cpu_share"]) == 2
    assert [row["op"] for row in prof["collectives"]["reducescatter"]][:1] == ["reducescatter"]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("rayspeed-calibration")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].data.params["ranks"] == "2"
    assert [a.path for a in client.list_artifacts(runs[0].info.run_id, "profile")] == ["profile/profile.json"]

    plan = subprocess.run([sys.executable, "-m", "rayspeed", "plan", os.path.join(ROOT, "configs", "tiny-cpu.yaml"),
                           "--profile", str(out), "--json"],
                          env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    best = json.loads(plan.stdout)["plan"]
    assert best["profile"]["path"] == str(out) and best["step_time_s"] > 0
