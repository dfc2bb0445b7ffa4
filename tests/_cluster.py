"""One real local Ray head per test session (started like `ray start --head`), and job runs through the
real entry point (`python jobs/train.py`) joined to it through RAY_ADDRESS."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The kill drills' uninterrupted run (conftest's zero2_reference): a drill sets its own name, cadence and chaos on top.
ZERO2_REFERENCE = ["--config", str(ROOT / "configs" / "tiny-cpu.yaml"), "--set", "train.max_steps=30",
                   "--set", "parallel.zero_stage=2", "--set", "cluster.num_workers=2", "--set",
                   "tracking.log_every_steps=1", "--set", "train.eval_every_steps=0", "--set",
                   "resilience.checkpoint_every_steps=0", "--set", "tracking.loss_landscape=false", "--set",
                   "tracking.charts_every_checkpoints=0"]
VENV_BIN = Path(sys.executable).parent


# A test's Ray node stops with its process group (SIGTERM): the GCS goes with it, so the node's drain on SIGTERM
# (30 s by default: it waits for the GCS to accept a drain) only delays the end of the session.
QUICK_STOP = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_ip() -> str:
    # The address Ray itself picks for this node (drivers must join with the same one).
    from ray._private.services import get_node_ip_address

    return get_node_ip_address()


class RayHead:
    def __init__(self, log_dir: Path, num_cpus: int = 8):
        self.port = free_port()
        self.address = f"{_node_ip()}:{self.port}"
        self.log = open(Path(log_dir) / f"ray-head-{self.port}.log", "w")
        ray_bin = VENV_BIN / "ray"
        # `ray start` with token auth needs the token to exist (ray.init makes one, `ray start` does not): a module
        # run alone on a fresh HOME would otherwise depend on an earlier test having called ray.init.
        subprocess.run([str(ray_bin), "get-auth-token", "--generate"], check=True, stdout=subprocess.DEVNULL,
                       env=dict(os.environ, RAY_AUTH_MODE="token"))
        self.proc = subprocess.Popen(
            [str(ray_bin), "start", "--head", "--block", "--port", str(self.port), "--num-cpus", str(num_cpus),
             "--dashboard-host", "127.0.0.1", "--dashboard-port", str(free_port()),
             # Non-default ports: other Ray clusters on this machine (make up, other tests) keep theirs.
             "--dashboard-agent-listen-port", str(free_port()), "--ray-client-server-port", str(free_port()),
             "--disable-usage-stats"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, RAY_AUTH_MODE="token", **QUICK_STOP),
        )
        self._wait()

    def _wait(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    time.sleep(2)  # raylet and dashboard come up right after the GCS
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray head exited: see {self.log.name}")
            time.sleep(0.5)
        raise RuntimeError(f"ray head did not start in {timeout}s: see {self.log.name}")

    def stop(self) -> None:
        stop_process_group(self.proc, 60)
        self.log.close()



def stop_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group a test service was started in (start_new_session=True), SIGKILL after grace_s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass

class StoreTemplate:
    """An empty MLflow SQLite store, made once per session by MLflow itself (its schema migrations take seconds,
    paid otherwise by every job's first launch in a fresh home) and copied into each home a Ray job starts from.
    Tests that check what a first launch writes start from an empty home (they do not use run_job)."""

    root: Path | None = None  # set by the session fixture in conftest.py
    path: Path | None = None

    @classmethod
    def seed(cls, home: Path) -> None:
        import shutil

        db = Path(home) / "mlflow.db"
        if db.exists() or cls.root is None:
            return
        if cls.path is None:
            from mlflow.tracking import MlflowClient

            made = cls.root / "mlflow.db"
            MlflowClient(f"sqlite:///{made}").search_experiments()
            cls.path = made
        Path(home).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(cls.path, db)


def seed_store(home: Path) -> None:
    StoreTemplate.seed(home)


def run_job(home: Path, args: list[str], ray_address: str | None, timeout: float = 600, env_extra: dict | None = None):
    """python jobs/train.py ... with RAYSPEED_HOME=home; returns (CompletedProcess, summary or None). The home's
    MLflow store starts as a copy of the session's empty one (when the job keeps tracking.uri auto)."""
    if not any(a.startswith("tracking.uri=") for a in args):
        seed_store(home)
    env = dict(os.environ, RAYSPEED_HOME=str(home), PYTHONUNBUFFERED="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
        env["RAY_AUTH_MODE"] = "token"
    else:
        env.pop("RAY_ADDRESS", None)
    env.update(env_extra or {})
    r = subprocess.run([sys.executable, str(ROOT / "jobs" / "train.py"), *args], env=env, capture_output=True,
                       text=True, timeout=timeout)
    summary = None
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{") and '"status"' in line:
            summary = json.loads(line)
            break
    return r, summary


def metric_history(home: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    hist = sorted(c.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    return [(m.step, m.value) for m in hist]
