"""MLflow: one run per job name, rank-0 logger that never blocks training (real SQLite store and server)."""

import socket
import subprocess
import sys
import time

import pytest

from rayspeed.config import parse
from rayspeed.paths import storage_path, tracking_uri
from rayspeed.tracking.logger import MlflowLogger
from rayspeed.tracking.runs import find_or_create_run, finish_run


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSPEED_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def test_auto_uri_and_storage_follow_rayspeed_home(home):
    cfg = parse({"name": "j"})
    assert tracking_uri(cfg) == f"sqlite:///{home / 'mlflow.db'}"
    assert storage_path(cfg) == str(home / "runs")


def test_one_run_per_job_name(home):
    from mlflow.tracking import MlflowClient

    cfg = parse({"name": "same-job"})
    rid1, resumed1 = find_or_create_run(cfg)
    finish_run(cfg, rid1, "FAILED")
    rid2, resumed2 = find_or_create_run(cfg)
    other, _ = find_or_create_run(parse({"name": "other-job"}))
    assert rid1 == rid2 and not resumed1 and resumed2 and other != rid1
    run = MlflowClient(tracking_uri(cfg)).get_run(rid1)
    assert run.info.run_name == "same-job" and run.data.tags["rayspeed.job"] == "same-job"
    assert run.info.status == "RUNNING"
    exp = MlflowClient(tracking_uri(cfg)).get_experiment(run.info.experiment_id)
    assert exp.artifact_location.startswith((home / "mlartifacts").as_uri())


def test_an_experiment_made_elsewhere_opens_as_model_training_in_the_ui(home):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    plain = client.create_experiment("made-by-mlflow")  # no kind: MLflow 3's UI would open its GenAI view
    chosen = client.create_experiment("chosen", tags={"mlflow.experimentKind": "genai_development"})
    for name in ("made-by-mlflow", "chosen"):
        find_or_create_run(parse({"name": "j", "tracking": {"experiment": name}}))
    assert client.get_experiment(plain).tags["mlflow.experimentKind"] == "custom_model_development"
    assert client.get_experiment(chosen).tags["mlflow.experimentKind"] == "genai_development"  # a kind chosen stays


def test_logger_delivers_metrics_params_and_artifacts(home):
    from mlflow.tracking import MlflowClient

    cfg = parse({"name": "logged"})
    rid, _ = find_or_create_run(cfg)
    lg = MlflowLogger(tracking_uri(cfg), rid)
    for s in range(1, 4):
        lg.log_metrics({"train/loss": 5.0 - s}, step=s)
    lg.log_params({"a.b": 1, "c": [1, 2]})
    lg.log_params({"a.b": 2})  # a re-plan: recorded as a tag, the param keeps its first value
    lg.log_text("hello", "config/resolved.yaml")
    assert lg.flush(60)
    lg.close()
    c = MlflowClient(tracking_uri(cfg))
    hist = c.get_metric_history(rid, "train/loss")
    assert [(m.step, m.value) for m in hist] == [(1, 4.0), (2, 3.0), (3, 2.0)]
    run = c.get_run(rid)
    assert run.data.params["a.b"] == "1" and run.data.params["c"] == "[1, 2]"
    assert run.data.tags["replan.a.b"] == "2"
    assert [a.path for a in c.list_artifacts(rid, "config")] == ["config/resolved.yaml"]



def test_logger_coalesces_metrics_into_few_requests(home):
    """Records logged faster than metrics_every_s leave in one request, in order with the params after them;
    flush() does not wait out the interval."""
    from mlflow.tracking import MlflowClient

    cfg = parse({"name": "coalesced"})
    rid, _ = find_or_create_run(cfg)
    lg = MlflowLogger(tracking_uri(cfg), rid, metrics_every_s=30.0)
    batches = []
    real = lg.client.log_batch

    def counting(run_id, metrics=(), params=(), tags=()):
        batches.append((len(metrics), len(params), len(tags)))
        return real(run_id, metrics=metrics, params=params, tags=tags)

    lg.client.log_batch = counting
    lg.log_metrics({"train/loss": 9.0}, step=0)  # the first record goes at once
    for s in range(1, 41):
        lg.log_metrics({"train/loss": 10.0 - s * 0.1, "train/lr": 1e-3}, step=s)
    lg.log_params({"after": 1})
    t0 = time.monotonic()
    assert lg.flush(20)
    assert time.monotonic() - t0 < 10  # flush cut the 30 s coalescing wait short
    lg.close()
    metric_batches = [b for b in batches if b[0]]
    assert len(metric_batches) <= 3 and sum(b[0] for b in metric_batches) == 81, batches
    assert batches[-1] == (0, 1, 0)  # the params record kept its place after the metrics
    hist = MlflowClient(tracking_uri(cfg)).get_metric_history(rid, "train/loss")
    assert sorted(m.step for m in hist) == list(range(41))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_logger_survives_server_outage(tmp_path):
    """Nothing blocks while the server is away; everything arrives once it is back."""
    from mlflow.tracking import MlflowClient

    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    db = f"sqlite:///{tmp_path / 'srv.db'}"

    def start():
        p = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
             "--backend-store-uri", db, "--artifacts-destination", str(tmp_path / "art"), "--workers", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 90
        while time.time() < deadline:
            try:
                MlflowClient(uri).search_experiments(max_results=1)
                return p
            except Exception:
                time.sleep(0.5)
        p.kill()
        pytest.fail("mlflow server did not start")

    def stop(p):
        import os
        import signal

        os.killpg(p.pid, signal.SIGTERM)
        p.wait(30)

    srv = start()
    client = MlflowClient(uri)
    exp = client.create_experiment("outage")
    rid = client.create_run(exp).info.run_id
    lg = MlflowLogger(uri, rid, retry_max_s=1.0)
    lg.log_metrics({"m": 0.0}, step=0)
    assert lg.flush(30)
    stop(srv)
    t0 = time.perf_counter()
    for s in range(1, 11):
        lg.log_metrics({"m": float(s)}, step=s)
    assert time.perf_counter() - t0 < 1.0  # the training loop never waits for the server
    assert not lg.flush(2)  # still queued
    srv = start()
    try:
        assert lg.flush(60)
        lg.close()
        assert sorted(m.step for m in client.get_metric_history(rid, "m")) == list(range(11))
    finally:
        stop(srv)


def test_training_waits_for_a_server_only_while_it_answers():
    """deliver() (what training waits on: before a checkpoint, on a failure) returns once a send failed, where flush()
    waits out its timeout; close() waits (bounded) for the server of a run that exists, not for one that never
    answered. A 2-step job with the tracking server down took 94 s from command to exit, 75 of them waiting."""
    with socket.socket() as s:  # a port nothing listens on: connection refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def no_server() -> str:
        raise ConnectionError("connection refused")

    lg = MlflowLogger(f"http://127.0.0.1:{port}", None, retry_max_s=1.0, run_factory=no_server)
    lg.log_metrics({"m": 1.0}, step=1)
    t0 = time.perf_counter()
    assert not lg.deliver(30)
    assert time.perf_counter() - t0 < 10  # the first send's failure, not the 30 s
    t0 = time.perf_counter()
    assert not lg.flush(2)
    assert time.perf_counter() - t0 >= 2  # flush waits its timeout, however long the server is away
    t0 = time.perf_counter()
    lg.close(timeout_s=60)
    assert time.perf_counter() - t0 < 1  # no run: the server never answered
    existing = MlflowLogger(f"http://127.0.0.1:{port}", "a-run", retry_max_s=1.0)
    existing.log_metrics({"m": 1.0}, step=1)
    t0 = time.perf_counter()
    existing.close(timeout_s=2)
    assert time.perf_counter() - t0 >= 2  # a run's server is waited for, as long as close is told
