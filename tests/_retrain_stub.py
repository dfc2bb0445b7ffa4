"""The stub "training job" of the retraining tests (tests/retrain): it registers a prepared model in a real MLflow
store (SQLite in the test's home) and writes the job's summary, and can act as another host that promotes
meanwhile; with the small job file it is given and the champion a test registers first."""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]

REG = "rayspeed-rt"

STUB = r'''
import json, os, sys
from pathlib import Path
sets = [a for p, a in zip(sys.argv, sys.argv[1:]) if p == "--set"]
name = next(s.split("=", 1)[1] for s in sets if s.startswith("name="))
reg = json.loads(next(s.split("=", 1)[1] for s in sets if s.startswith("tracking.register_model=")))
uri = os.environ["MLFLOW_TRACKING_URI"]
from rayspeed.tracking.client import mlflow_client
from rayspeed.tracking.registry import log_and_register, set_alias
c = mlflow_client(uri)
exp = c.get_experiment_by_name("stub")
from rayspeed.paths import artifact_root
exp_id = exp.experiment_id if exp else c.create_experiment("stub", artifact_location=artifact_root(uri))
def register(model_dir, val):
    run = c.create_run(exp_id).info.run_id
    return run, log_and_register(uri, run, model_dir, reg, metrics={"val/loss": val})
run, version = register(os.environ["STUB_MODEL_DIR"], float(os.environ["STUB_VAL_LOSS"]))
if os.environ.get("STUB_OTHER_HOST_PROMOTES"):  # meanwhile, another cycle promotes its own version
    _, other = register(os.environ["STUB_OTHER_HOST_PROMOTES"], 0.5)
    set_alias(uri, reg, other)
out = Path(os.environ["RAYSPEED_HOME"]) / "runs" / name
out.mkdir(parents=True, exist_ok=True)
(out / "summary.json").write_text(json.dumps({"status": "finished", "val_loss": float(os.environ["STUB_VAL_LOSS"]),
                                              "mlflow_run_id": run, "registered_model_version": version}))
'''


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSPEED_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "platform"), os.environ.get("PYTHONPATH", "")]))
    return tmp_path


def job_file(home: Path) -> str:
    corpus = home / "corpus"
    corpus.mkdir(exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for n in ("json/__init__.py", "json/decoder.py"):
        shutil.copy(stdlib / n, corpus / n.replace("/", "_"))
    cfg = home / "job.yaml"
    cfg.write_text(f"""
name: rt
model: {{hidden_size: 32, num_layers: 1, num_heads: 2, ffn_hidden_size: 64, vocab_size: 256, seq_len: 32}}
data: {{source: files, path: "{corpus}/*.py", tokenizer: bytes, val_fraction: 0.1}}
train: {{global_batch_size: 8, max_steps: 6, eval_batches: 2}}
cluster: {{num_workers: 1}}
""")
    return str(cfg)


def export_random(home: Path, cfg_path: str, name: str, scale: float = 1.0) -> str:
    """A rayspeed export of the job's model, randomly initialised; scale > 1 makes its logits (and loss) worse."""
    import torch

    from rayspeed.config.load import load
    from rayspeed.config.shape import ModelShape
    from rayspeed.model.export import export_model
    from rayspeed.model.transformer import Transformer

    cfg = load(cfg_path)
    model = Transformer(ModelShape.from_config(cfg.model), tp=None, seed=1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    out = home / "exports" / name
    export_model(model, SimpleNamespace(name="rt", model=cfg.model, train=SimpleNamespace(seed=1, precision="fp32"),
                                        parallel=None), str(out))
    return str(out)


def register_champion(home: Path, model_dir: str, val: float, data_hash: str | None = None) -> None:
    """Version 1 of REG, under the alias champion, as an earlier cycle would have left it."""
    from rayspeed.tracking.client import mlflow_client
    from rayspeed.tracking.registry import log_and_register, set_alias

    uri = f"sqlite:///{home / 'mlflow.db'}"
    c = mlflow_client(uri)
    run = c.create_run(c.create_experiment("earlier", artifact_location=(home / "mlartifacts").as_uri())).info.run_id
    v = log_and_register(uri, run, model_dir, REG, metrics={"val/loss": val},
                         extra_tags={"rayspeed.data_hash": data_hash} if data_hash else None)
    assert v == "1" and set_alias(uri, REG, v)


def stub_command(home: Path) -> list[str]:
    path = home / "stub_job.py"
    path.write_text(STUB)
    return [sys.executable, str(path)]


def client(home: Path):
    from rayspeed.tracking.client import mlflow_client

    return mlflow_client(f"sqlite:///{home / 'mlflow.db'}")
