"""The five dashboard charts, rendered with real matplotlib from a real MLflow run's history (SQLite store):
a CPU run (GPU-only charts say so on the image), a GPU-shaped run (every chart has data), the landscape's
unavailable/missing cases, and the background publisher that logs them as charts/*.png."""

from __future__ import annotations

import math
import tempfile
import time

import pytest
from PIL import Image

from rayspeed.config import parse
from rayspeed.paths import tracking_uri
from rayspeed.tracking.charts import CHART_FILES, ChartPublisher, render_charts
from rayspeed.tracking.logger import MlflowLogger
from rayspeed.tracking.runs import find_or_create_run


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One SQLite store for the module (creating one costs seconds); each test uses its own job name."""
    tmp = tmp_path_factory.mktemp("charts")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYSPEED_HOME", str(tmp))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        yield tmp


def _desc(path):
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] >= 600 and im.size[1] >= 300
        return im.text.get("Description", "")


def _log_history(lg, gpu, nodes=2, ranks_per_node=2, steps=range(5, 85, 5), restart_at=45, fraction=None):
    for step in steps:
        m = {"train/loss": 5.0 / math.sqrt(step), "resilience/restarts": 0 if step < restart_at else 1}
        frac = fraction(step) if fraction else 0.15 + 0.1 * math.sin(step / 10.0)
        m["comm/grad_sync_fraction"] = frac
        for n in range(nodes):
            for j in range(ranks_per_node):
                r = n * ranks_per_node + j
                if step > 60 and r == nodes * ranks_per_node - 1:
                    continue  # the last rank went away (resize)
                base = f"system/node{n}/rank{r}"
                m[f"{base}/cpu_percent"] = 40.0 + 5 * n
                m[f"{base}/proc_cpu_percent"] = 85.0 + 10 * math.sin(step / 7.0 + r)
                if gpu:
                    m[f"{base}/gpu_util_percent"] = 70.0 + 20 * math.sin(step / 9.0 + r) - (30 if n == 1 else 0)
                    m[f"{base}/gpu_mem_fragmentation"] = 0.05 + 0.002 * step + 0.02 * r
        if gpu:
            m["memory/fragmentation"] = 0.05 + 0.002 * step + 0.02 * (nodes * ranks_per_node - 1)
            m["memory/peak_allocated_gib"] = 61.5
        lg.log_metrics(m, step=step)


def _run(name, gpu, **kw):
    cfg = parse({"name": name})
    uri = tracking_uri(cfg)
    rid, _ = find_or_create_run(cfg)
    lg = MlflowLogger(uri, rid)
    lg.log_params({"cluster.use_gpu": gpu})
    _log_history(lg, gpu, **kw)
    assert lg.flush(60)
    return uri, rid, lg


LANDSCAPE_1D = {"alphas": [-1, -0.5, 0, 0.5, 1], "losses": [6.1, 4.2, 3.3, 4.0, 5.8], "center_loss": 3.3,
                "two_d": False, "seed": 1, "span": 1.0, "num_batches": 4}


def _landscape_2d():
    a = [-1 + 0.25 * i for i in range(9)]
    grid = [[3.0 + 2.0 * x * x + 1.2 * y * y + 0.4 * x * y for x in a] for y in a]
    return {"alphas": a, "betas": a, "grid": grid, "losses": grid[4], "center_loss": grid[4][4], "two_d": True,
            "seed": 2, "span": 1.0, "num_batches": 4}


def test_cpu_run_charts_say_what_is_missing(home):
    uri, rid, lg = _run("cpu-job", gpu=False)
    out = home / "cpu"
    paths = render_charts(uri, rid, str(out), landscape=LANDSCAPE_1D)
    lg.close()
    assert [p.split("/")[-1] for p in paths] == list(CHART_FILES)
    d = {p.split("/")[-1]: _desc(p) for p in paths}
    assert d["utilization_heatmap.png"].startswith("data: CPU utilization (no GPU)")
    assert d["grad_sync_fraction.png"].startswith("data:")
    assert d["compute_comm_ratio.png"].startswith("data:")
    assert d["loss_landscape.png"].startswith("data:")
    assert d["memory_fragmentation.png"].startswith("no data:") and "CPU" in d["memory_fragmentation.png"]
    assert (out / "loss_landscape.json").exists()


def test_gpu_run_charts_all_have_data(home):
    uri, rid, lg = _run("gpu-job", gpu=True, nodes=2, ranks_per_node=4)
    paths = render_charts(uri, rid, str(home / "gpu"), landscape=_landscape_2d())
    lg.close()
    d = {p.split("/")[-1]: _desc(p) for p in paths}
    assert all(v.startswith("data:") for v in d.values()), d
    assert "GPU utilization" in d["utilization_heatmap.png"]


def test_missing_and_unavailable_cases(home):
    # dp=1: the measured fraction is 0 throughout, so the ratio is infinite and the chart says so
    uri, rid, lg = _run("solo-job", gpu=False, nodes=1, ranks_per_node=1, fraction=lambda s: 0.0)
    unavailable = {"unavailable": "pipeline parallel (pp>1): each stage holds only part of the model"}
    paths = render_charts(uri, rid, str(home / "a"), landscape=unavailable)
    d = {p.split("/")[-1]: _desc(p) for p in paths}
    assert d["compute_comm_ratio.png"].startswith("no data:") and "infinite" in d["compute_comm_ratio.png"]
    assert d["grad_sync_fraction.png"].startswith("data:")  # a flat 0 is data
    assert "pipeline parallel" in d["loss_landscape.png"]
    lg.close()
    # a run that never reached a log step: five images, each saying why it is empty
    empty_rid, _ = find_or_create_run(parse({"name": "empty-job"}))
    d = {p.split("/")[-1]: _desc(p) for p in render_charts(uri, empty_rid, str(home / "b"))}
    assert len(d) == 5 and all(v.startswith("no data:") for v in d.values()), d
    assert "not computed yet" in d["loss_landscape.png"]


def test_publisher_logs_charts_and_keeps_the_landscape(home, monkeypatch):
    from mlflow.tracking import MlflowClient

    scratch = home / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))

    uri, rid, lg = _run("pub-job", gpu=False)
    pub = ChartPublisher(lg, uri, rid)
    assert pub.publish(landscape=LANDSCAPE_1D, wait_s=60)
    assert lg.flush(60)
    names = {a.path for a in MlflowClient(uri).list_artifacts(rid, "charts")}
    assert {f"charts/{f}" for f in CHART_FILES} <= names and "charts/loss_landscape.json" in names
    # a later refresh without a landscape reuses the logged one
    assert pub.publish(wait_s=60)
    assert "loss_landscape.png" in pub.last_paths
    assert lg.flush(60)
    got = MlflowClient(uri).download_artifacts(rid, "charts/loss_landscape.png", str(home / "dl"))
    assert _desc(got).startswith("data:")
    lg.close()
    # the folder that carried the charts to MLflow is gone
    assert not list(scratch.glob("rayspeed-*"))


def test_publisher_never_raises_when_the_server_is_gone(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    pub = ChartPublisher(None, "http://127.0.0.1:9", "0" * 32)
    t0 = time.perf_counter()
    assert pub.publish() is True  # returns at once; the work fails on its thread
    assert time.perf_counter() - t0 < 1.0
    pub.join(30)
    assert pub.last_paths == [] and pub._warned
