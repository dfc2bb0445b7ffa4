"""Seconds from launch to rank 0's first finished step, and to the end, with a closed MLflow port and with a
reachable MLflow server (a real `mlflow server` started here), tiny-cpu with --launcher local, 5 steps, twice each.
One JSON line per run.

    python scripts/measure_tracking_down.py [--reps 2]
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable



def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(uri, home):
    os.makedirs(home, exist_ok=True)
    env = dict(os.environ, RAYSPEED_HOME=home, MLFLOW_TRACKING_URI=uri, PYTHONUNBUFFERED="1")
    t0 = time.time()
    p = subprocess.Popen([PY, f"{ROOT}/jobs/train.py", "--config", f"{ROOT}/configs/tiny-cpu.yaml", "--launcher",
                          "local", "--set", "train.max_steps=5", "--set", "tracking.log_every_steps=1", "--set",
                          "train.eval_every_steps=0", "--set", "tracking.loss_landscape=false", "--set",
                          "resilience.checkpoint_every_steps=0"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    for line in p.stdout:
        if first is None and "step 1/5" in line:
            first = time.time() - t0
    p.wait()
    return first, time.time() - t0, p.returncode

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="rayspeed-tracking-down-")
    closed = f"http://127.0.0.1:{free_port()}"
    port = free_port()
    srv = subprocess.Popen([PY, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                            "--backend-store-uri", f"sqlite:///{work}/srv.db",
                            "--artifacts-destination", f"{work}/art", "--workers", "1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    from mlflow.tracking import MlflowClient
    for _ in range(240):
        try:
            MlflowClient(f"http://127.0.0.1:{port}").search_experiments(max_results=1)
            break
        except Exception:
            time.sleep(0.5)
    res = []
    for i in range(a.reps):
        res.append(("up", *run(f"http://127.0.0.1:{port}", f"{work}/up{i}")))
        res.append(("closed", *run(closed, f"{work}/closed{i}")))
    os.killpg(srv.pid, 15)
    shutil.rmtree(work, ignore_errors=True)
    for r in res:
        print(json.dumps({"server": r[0], "first_step_s": round(r[1], 2), "total_s": round(r[2], 2), "rc": r[3]}))


if __name__ == "__main__":
    main()
