"""Records a tracking server never got (away until the job ended) are kept beside the run's checkpoints and
delivered to the same run by the job's next launch (rayspeed.tracking.spool): a real `mlflow server`, stopped and
started again."""

import functools
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from _cluster import free_port
from rayspeed.tracking.logger import MlflowLogger
from rayspeed.tracking.spool import deliver_spool, spooled, write_spool


def _server(port, db, art):
    from mlflow.tracking import MlflowClient

    p = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                          "--backend-store-uri", db, "--artifacts-destination", art, "--workers", "1"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            MlflowClient(f"http://127.0.0.1:{port}").search_experiments(max_results=1)
            return p
        except Exception:
            time.sleep(0.5)
    os.killpg(p.pid, signal.SIGKILL)
    pytest.fail("mlflow server did not start")


def _stop(p):
    os.killpg(p.pid, signal.SIGTERM)
    p.wait(30)


def test_what_a_dead_server_never_got_reaches_the_same_run_at_the_next_launch(tmp_path):
    from mlflow.tracking import MlflowClient

    port = free_port()
    uri, db, art = f"http://127.0.0.1:{port}", f"sqlite:///{tmp_path / 'srv.db'}", str(tmp_path / "art")
    srv = _server(port, db, art)
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("spool")).info.run_id
    _stop(srv)
    experiment = str(tmp_path / "runs" / "job")
    lg = MlflowLogger(uri, run_id, retry_max_s=1.0, spool=functools.partial(write_spool, experiment))
    for step in (1, 2, 3):
        lg.log_metrics({"train/loss": 5.0 - step}, step=step)
    lg.log_params({"train.lr": 0.003})
    lg.set_tags({"rayspeed.status": "finished"})
    lg.log_text("the end", "notes/end.txt")
    lg.close(timeout_s=2)
    (name,) = spooled(experiment)
    lines = [json.loads(x) for x in (tmp_path / "runs" / "job" / name).read_text().splitlines()]
    assert lines[0] == {"run_id": run_id} and {r["kind"] for r in lines[1:]} == {"metrics", "params", "tags", "text"}
    srv = _server(port, db, art)
    try:
        assert deliver_spool(experiment, uri, run_id) == len(lines) - 1
        assert spooled(experiment) == []  # delivered: nothing left for the next launch
        run = client.get_run(run_id)
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [(1, 4.0), (2, 3.0),
                                                                                               (3, 2.0)]
        assert run.data.params["train.lr"] == "0.003" and run.data.tags["rayspeed.status"] == "finished"
        assert "notes" in {a.path for a in client.list_artifacts(run_id)}
    finally:
        _stop(srv)
