"""The final model: exported from the DeepSpeed engine of any layout (ZeRO-2 over dp, bf16 masters, tp, pp),
reloaded without DeepSpeed to the same loss, logged as the run's model/ artifact and registered (real MLflow,
SQLite store), aliased champion. The distributed exports run in the 2-process gloo world test_monitoring
starts once per session (shared_world)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from _deepspeed_world import MODEL, _batch, job_cfg, shared_world

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return shared_world(tmp_path_factory)[0]["exports"]


def _loaded_loss(path):
    from rayspeed.model.export import load_model

    x, y = _batch(999)
    model = load_model(path)
    with torch.no_grad():
        return float(model(x, y)), model


@pytest.mark.parametrize("layout", ["zero2", "tp2", "pp2", "zero3"])
def test_reloaded_model_gives_the_engines_loss(exported, layout):
    e = exported[layout]
    loss, model = _loaded_loss(e["path"])
    assert loss == pytest.approx(e["engine_loss"], rel=1e-5, abs=1e-6), layout
    assert not model.training and next(model.parameters()).dtype == torch.float32
    meta = json.loads(open(f"{e['path']}/export.json").read())
    assert meta["complete"] and meta["limitations"] == []
    assert meta["layout"]["tp" if layout == "tp2" else "pp" if layout == "pp2" else "dp"] == 2
    assert meta["layout"]["zero_stage"] == {"zero2": 2, "zero3": 3}.get(layout, 1)


def test_landscape_declines_layouts_it_cannot_perturb(exported):
    assert "ZeRO-3" in exported["zero3"]["landscape"]["unavailable"]
    assert "tensor parallel" in exported["tp2"]["landscape"]["unavailable"]
    assert "pipeline" in exported["pp2"]["landscape"]["unavailable"]


def test_zero2_fp32_export_is_exact(exported):
    e = exported["zero2"]
    loss, _ = _loaded_loss(e["path"])
    assert loss == e["engine_loss"]  # same fp32 weights, same ops


def test_bf16_export_holds_the_fp32_masters(exported):
    e = exported["bf16"]
    assert e["bf16_dtype"] == "torch.bfloat16"
    state = torch.load(f"{e['path']}/weights.pt", weights_only=True)
    w = state["layers.0.attn.wq.weight"]
    assert w.dtype == torch.float32 and torch.equal(w, e["master"].float())
    assert not torch.equal(w, w.to(torch.bfloat16).float())  # not the rounded module copy
    loss, _ = _loaded_loss(e["path"])
    assert loss == pytest.approx(e["engine_loss"], rel=2e-2)  # the engine ran in bf16
    meta = json.loads(open(f"{e['path']}/export.json").read())
    assert "master" in meta["weights_from"]


def test_export_directory_is_self_describing(exported):
    path = exported["zero2"]["path"]
    spec = json.loads(open(f"{path}/model_config.json").read())
    assert spec["model"]["hidden_size"] == MODEL["hidden_size"] and spec["model"]["num_kv_heads"] == 2
    assert "load_model" in open(f"{path}/README.md").read()
    state = torch.load(f"{path}/weights.pt", weights_only=True)
    assert "head.weight" in state and torch.equal(state["head.weight"], state["embed.weight"])  # tied


def test_plain_module_export_and_size_guard(tmp_path):
    from rayspeed.model import Transformer
    from rayspeed.model.export import export_model, load_model

    cfg = job_cfg(1)
    model = Transformer(SimpleNamespace(**MODEL, tie_embeddings=True), seed=5)
    p = export_model(model, cfg, str(tmp_path / "plain"))
    x, y = _batch(3)
    with torch.no_grad():
        assert float(load_model(p)(x, y)) == float(model(x, y))
    big = export_model(model, cfg, str(tmp_path / "big"), max_host_gib=1e-9)
    meta = json.loads(open(f"{big}/export.json").read())
    assert not meta["complete"] and "zero_to_fp32" in meta["limitations"][0]
    with pytest.raises(FileNotFoundError, match="max_host_gib"):
        load_model(big)


# ------------------------------------------------------------------------------------------- registry
@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSPEED_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def test_log_and_register_then_champion_alias(exported, home, tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    from rayspeed.config import parse
    from rayspeed.model.export import load_model
    from rayspeed.paths import tracking_uri
    from rayspeed.tracking.registry import (
        get_alias_version,
        log_and_register,
        model_uri,
        set_alias,
        version_metrics,
    )
    from rayspeed.tracking.runs import find_or_create_run, registered_model_name

    cfg = parse({"name": "reg-job"})
    uri = tracking_uri(cfg)
    rid, _ = find_or_create_run(cfg)
    name = registered_model_name(cfg)
    path = exported["zero2"]["path"]
    v1 = log_and_register(uri, rid, path, name, {"val/loss": 2.5, "train/loss": 2.25})
    v2 = log_and_register(uri, rid, path, name, {"val/loss": 2.0})
    assert (v1, v2) == ("1", "2")
    c = MlflowClient(uri)
    assert {a.path for a in c.list_artifacts(rid, "model")} >= {"model/weights.pt", "model/model_config.json",
                                                                 "model/export.json", "model/README.md"}
    mv = c.get_model_version(name, v1)
    assert mv.run_id == rid and mv.source.endswith("/model") and mv.tags["metric.val/loss"] == "2.5"
    assert version_metrics(uri, name, v1) == {"val/loss": 2.5, "train/loss": 2.25}

    assert get_alias_version(uri, name) is None
    assert set_alias(uri, name, v1) and get_alias_version(uri, name) == "1"
    assert set_alias(uri, name, v2) and get_alias_version(uri, name) == "2"  # promotion moves the alias
    assert model_uri(name) == f"models:/{name}@champion" and model_uri(name, 2) == f"models:/{name}/2"

    mlflow.set_tracking_uri(uri)
    local = mlflow.artifacts.download_artifacts(model_uri(name), dst_path=str(tmp_path / "dl"))
    x, y = _batch(999)
    with torch.no_grad():
        assert float(load_model(local)(x, y)) == exported["zero2"]["engine_loss"]


@pytest.mark.timeout(120)  # a hang fails here rather than at the session's limit
def test_registry_survives_a_missing_server(exported, tmp_path, monkeypatch):
    """Against a dead server each call returns None/False and never raises; it cannot hang because its work runs on
    a daemon thread that the caller waits for at most the call's timeout_s: those waits are what is checked (a
    wall-clock bound would only measure this machine)."""
    import threading

    from rayspeed.tracking import registry

    waits = []

    class Watched(threading.Thread):
        def join(self, timeout=None):
            waits.append((self.name, self.daemon, timeout))
            super().join(timeout)

    monkeypatch.setattr(registry, "threading", SimpleNamespace(Thread=Watched))
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    assert registry.log_and_register(dead, "0" * 32, exported["zero2"]["path"], "m", {"a": 1}, timeout_s=2) is None
    assert registry.set_alias(dead, "m", 1, timeout_s=1) is False
    assert registry.get_alias_version(dead, "m", timeout_s=1) is None
    assert waits == [("rayspeed-registry-model upload", True, 2), ("rayspeed-registry-set alias champion", True, 1),
                     ("rayspeed-registry-read alias champion", True, 1)]  # the upload failed: nothing registered
