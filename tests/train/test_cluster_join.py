"""Joining clusters the job did not start: Ray's token authentication is never guessed from ~/.ray/auth_token, a
refusal is one line saying what to do, and `auto` storage/tracking refuses to guess on a cluster of several nodes.
Real Ray clusters (`ray start`, two nodes on this machine), real jobs through jobs/train.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _cluster import QUICK_STOP, ROOT, VENV_BIN, free_port, stop_process_group

TOKEN = "0123456789abcdef" * 4
JOB = ["--config", str(ROOT / "configs" / "tiny-cpu.yaml"), "--set", "name=join", "--set", "train.max_steps=4",
       "--set", "tracking.loss_landscape=false", "--set", "health.preflight=false", "--set",
       "train.eval_every_steps=0", "--set", "resilience.checkpoint_every_steps=0"]


def _home(tmp: Path, token: bool) -> Path:
    home = tmp / ("home-token" if token else "home-empty")
    (home / ".ray").mkdir(parents=True, exist_ok=True)
    if token:
        (home / ".ray" / "auth_token").write_text(TOKEN)
    return home


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
    env.update(HOME=str(home), PYTHONUNBUFFERED="1", RAYSPEED_HOME=str(home), **extra)
    return env


class Cluster:
    """A head (and optional second node) started with `ray start` and the given auth mode."""

    def __init__(self, tmp: Path, auth: str, nodes: int = 1):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        env = _env(_home(tmp, token=auth == "token"), RAY_AUTH_MODE=auth, **QUICK_STOP)
        self.procs = []
        def base() -> list[str]:  # free ports of its own for every node: other clusters on this machine keep theirs
            return ["--block", "--num-cpus", "3", "--disable-usage-stats", "--node-ip-address", "127.0.0.1",
                    "--dashboard-agent-listen-port", str(free_port()), "--metrics-export-port", str(free_port())]

        self._start([str(VENV_BIN / "ray"), "start", "--head", "--port", str(self.port), "--include-dashboard",
                     "false", "--ray-client-server-port", str(free_port()), *base()], env, tmp / "head.log")
        for i in range(1, nodes):
            self._start([str(VENV_BIN / "ray"), "start", "--address", self.address, *base()], env,
                        tmp / f"node{i}.log")
        self._wait_nodes(nodes, env)

    def _start(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.procs.append(subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def _wait_nodes(self, nodes: int, env: dict[str, str], timeout: float = 120) -> None:
        code = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
                "print(sum(1 for n in ray.nodes() if n['Alive']))")
        deadline = time.time() + timeout
        while time.time() < deadline:
            r = subprocess.run([sys.executable, "-c", code, self.address], env=env, capture_output=True, text=True)
            if r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == [str(nodes)]:
                return
            time.sleep(1)
        raise RuntimeError(f"{nodes} Ray node(s) did not come up at {self.address}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            stop_process_group(p, 30)


def _train(env: dict[str, str], *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "jobs" / "train.py"), *JOB, *extra], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.ray
@pytest.mark.slow  # a heavier end-to-end drill: `make test-slow`
def test_a_token_file_does_not_turn_on_auth_for_a_cluster_without_it(tmp_path):
    """The driver's HOME holds a token (from an earlier `make train`); the cluster runs without authentication.
    Before, the launcher guessed RAY_AUTH_MODE=token from the file and the job died with ActorDiedError. With two
    nodes, `auto` storage and tracking must not guess either; explicit ones train."""
    cluster = Cluster(tmp_path, auth="disabled", nodes=2)
    try:
        env = _env(_home(tmp_path, token=True), RAY_ADDRESS=cluster.address)
        r = _train(env)
        assert r.returncode == 2, r.stderr[-3000:]
        err = r.stderr.strip().splitlines()[-1]
        assert err.startswith("config error: storage.path and tracking.uri: auto would put") and \
            "other 1 node(s)" in err, err
        shared = tmp_path / "shared"
        r = _train(env, "--set", f"storage.path={shared / 'runs'}", "--set",
                   f"tracking.uri=sqlite:///{shared / 'mlflow.db'}")
        assert r.returncode == 0, r.stderr[-4000:]
        assert '"status": "finished"' in r.stdout and (shared / "runs" / "join" / "summary.json").exists()
    finally:
        cluster.stop()


@pytest.mark.ray
def test_a_cluster_that_refuses_the_driver_is_one_line_exit_2(tmp_path):
    cluster = Cluster(tmp_path, auth="token")
    try:
        home = _home(tmp_path, token=False)
        for extra in ({}, {"RAY_AUTH_MODE": "token"}):  # no token mode at all / token mode without a token
            env = _env(home, RAY_ADDRESS=cluster.address, **extra)
            r = _train(env, "--set", f"storage.path={tmp_path / 'runs'}", timeout=300)
            assert r.returncode == 2, r.stderr[-3000:]
            last = r.stderr.strip().splitlines()[-1]
            assert last.startswith("config error: RAY_ADDRESS:") and "token" in last and "auth" in last, last
            assert "Traceback" not in r.stderr
        assert not (tmp_path / "runs").exists()
    finally:
        cluster.stop()
