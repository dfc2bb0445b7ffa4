"""The tracking server going away never kills or stalls training: a tiny-cpu run of 40 steps against a real
`mlflow server` that is stopped for 20 s mid-run and restarted finishes, and the server then holds all 40
train/loss points in one run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from _cluster import ROOT, free_port

TINY = str(ROOT / "configs" / "tiny-cpu.yaml")


def _server(port, db, art):
    return subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", db, "--artifacts-destination", art, "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _stop(p):
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(p.pid, signal.SIGKILL)


def _points(uri, name):
    from mlflow.tracking import MlflowClient

    c = MlflowClient(uri)
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()],
                         filter_string=f"tags.`rayspeed.job` = '{name}'")
    if not runs:
        return None, []
    return runs, c.get_metric_history(runs[0].info.run_id, "train/loss")


def _wait_up(uri, timeout=120):
    from mlflow.tracking import MlflowClient

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            MlflowClient(uri).search_experiments(max_results=1)
            return
        except Exception:
            time.sleep(0.5)
    pytest.fail("mlflow server did not start")


@pytest.mark.slow  # a heavier end-to-end drill: `make test-slow`
def test_training_survives_a_20s_tracking_outage(tmp_path):
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    db, art = f"sqlite:///{tmp_path / 'server.db'}", str(tmp_path / "artifacts")
    srv = _server(port, db, art)
    _wait_up(uri)
    env = dict(os.environ, RAYSPEED_HOME=str(tmp_path), MLFLOW_TRACKING_URI=uri, PYTHONUNBUFFERED="1")
    name = "outage"
    # If training reaches step 40 while the server is down, the job waits for it (bounded) to deliver the rest.
    job = subprocess.Popen(
        [sys.executable, str(ROOT / "jobs" / "train.py"), "--config", TINY, "--launcher", "local",
         "--set", f"name={name}", "--set", "train.max_steps=40", "--set", "tracking.log_every_steps=1",
         "--set", "resilience.checkpoint_every_steps=20", "--set", "train.eval_every_steps=0"],
        env=env, stdout=open(tmp_path / "job.log", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            _, pts = _points(uri, name)
            if len(pts) >= 3:
                break
            time.sleep(0.5)
        else:
            pytest.fail("no metrics arrived before the outage")
        _stop(srv)
        t_down = time.time()
        time.sleep(20)
        assert job.poll() is None or job.returncode == 0  # training did not die with the server
        srv = _server(port, db, art)
        _wait_up(uri)
        rc = job.wait(timeout=600)
        log = (tmp_path / "job.log").read_text()
        assert rc == 0, log[-4000:]
        runs, pts = _points(uri, name)
        assert len(runs) == 1  # one run per job
        assert sorted(m.step for m in pts) == list(range(1, 41))
        summary = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["mlflow_run_id"] == runs[0].info.run_id
        assert "queueing and retrying" in log  # warned (once) while the server was away
        assert log.count("queueing and retrying") == 1
        print(f"\noutage: server down {20:.0f} s from {t_down:.0f}; all 40 points delivered")
    finally:
        if job.poll() is None:
            job.kill()
        _stop(srv)


def test_a_server_that_is_down_at_launch_gets_the_run_once_it_comes_up(tmp_path):
    """The launch does not wait for a closed port (one try of a few seconds, one line), training starts, and the
    job's run, its params and every metric appear once a server comes up on that port."""
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    db, art = f"sqlite:///{tmp_path / 'server.db'}", str(tmp_path / "artifacts")
    env = dict(os.environ, RAYSPEED_HOME=str(tmp_path), MLFLOW_TRACKING_URI=uri, PYTHONUNBUFFERED="1")
    name = "late-server"
    t0 = time.time()
    job = subprocess.Popen(
        [sys.executable, str(ROOT / "jobs" / "train.py"), "--config", TINY, "--launcher", "local",
         "--set", f"name={name}", "--set", "train.max_steps=30", "--set", "tracking.log_every_steps=1",
         "--set", "resilience.checkpoint_every_steps=0", "--set", "train.eval_every_steps=0",
         "--set", "tracking.loss_landscape=false"],
        env=env, stdout=open(tmp_path / "job.log", "w"), stderr=subprocess.STDOUT)
    srv = None
    try:
        deadline = time.time() + 120
        while "does not answer" not in (tmp_path / "job.log").read_text():
            assert job.poll() is None and time.time() < deadline, (tmp_path / "job.log").read_text()[-3000:]
            time.sleep(0.2)
        print(f"\nclosed port: the launcher moved on {time.time() - t0:.1f} s after it started")
        srv = _server(port, db, art)
        _wait_up(uri)
        rc = job.wait(timeout=600)
        log = (tmp_path / "job.log").read_text()
        assert rc == 0, log[-4000:]
        (line,) = [x for x in log.splitlines() if "does not answer" in x]
        assert "training starts now" in line
        runs, pts = _points(uri, name)
        assert runs is not None and len(runs) == 1, log[-3000:]
        run = runs[0]
        assert sorted(m.step for m in pts) == list(range(1, 31))
        assert run.data.params.get("train.max_steps") == "30" and run.info.status == "FINISHED"
        # the given `auto`s and, beside them, where things really are
        assert run.data.params["storage.path"] == "auto" and run.data.params["tracking.uri"] == "auto"
        assert run.data.params["storage.path.resolved"] == str(tmp_path / "runs")
        assert run.data.params["tracking.uri.resolved"] == uri
        summary = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["mlflow_run_id"] == run.info.run_id
        # where the launcher finds the run even when the job fails
        recorded = json.loads((tmp_path / "runs" / name / "mlflow_run.json").read_text())
        assert recorded["run_id"] == run.info.run_id
    finally:
        if job.poll() is None:
            job.kill()
        if srv is not None:
            _stop(srv)
