"""MLflow with authentication, against a real server (`mlflow server --app-name basic-auth`, tests/_mlflow_auth.py),
and no secret written anywhere, through a real job (`--launcher local`):

- a job with MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD in its environment logs its run, and the secrets
  it was given (a token in cluster.env, the password in the tracking URI) are in none of: the job's log and
  output, MLflow params, tags and artifacts (config/resolved.yaml, health/preflight.json, ...), the server's
  store and artifact folder, the job's storage;
- without credentials the launcher refuses in one line naming MLFLOW_TRACKING_USERNAME/PASSWORD (exit 2) before
  anything is written;
- the launcher hands the credentials (and cluster.env) to the Ray workers' environment unmasked and logs none.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAKE_TOKEN = "hf_FAKEtok3n-9f8e7d6c5b4a"


def _job(tmp: Path) -> Path:
    corpus = tmp / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for n in ("json/__init__.py", "json/decoder.py", "json/encoder.py"):
        shutil.copy(stdlib / n, corpus / n.replace("/", "_"))
    cfg = tmp / "job.yaml"
    cfg.write_text(f"""
name: authjob
model: {{hidden_size: 32, num_layers: 1, num_heads: 2, ffn_hidden_size: 64, vocab_size: 256, seq_len: 32}}
data: {{source: files, path: "{corpus}/*.py", tokenizer: bytes, val_fraction: 0.05}}
train: {{global_batch_size: 8, max_steps: 4, eval_every_steps: 2, eval_batches: 1, warmup_steps: 1}}
cluster: {{num_workers: 1, env: {{HF_TOKEN: "{FAKE_TOKEN}"}}}}
resilience: {{checkpoint_every_steps: 2}}
tracking: {{log_every_steps: 2, system_metrics: false, loss_landscape: false, charts_every_checkpoints: 0}}
""")
    return cfg


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
    env.update(RAYSPEED_HOME=str(home), PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "platform"), os.environ.get("PYTHONPATH", "")])
    env.pop("RAY_ADDRESS", None)
    return env


def _train(cfg: Path, env: dict[str, str], *sets: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rayspeed", "train", "--config", str(cfg), "--launcher", "local"]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _files_holding(root: Path, needles: list[str]) -> list[str]:
    found = []
    for p in root.rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            found += [f"{p}: {n[:6]}..." for n in needles if n.encode() in data]
    return found


def test_without_credentials_the_launcher_refuses_in_one_line(mlflow_auth, tmp_path):
    cfg = _job(tmp_path)
    p = _train(cfg, _env(tmp_path, MLFLOW_TRACKING_URI=mlflow_auth.uri))
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("config error: MLFLOW_TRACKING_URI: the MLflow server at ")
    assert "MLFLOW_TRACKING_USERNAME" in lines[0] and "MLFLOW_TRACKING_PASSWORD" in lines[0] and "401" in lines[0]
    assert not (tmp_path / "runs").exists()  # nothing written
    wrong = _train(cfg, _env(tmp_path, MLFLOW_TRACKING_URI=mlflow_auth.uri, MLFLOW_TRACKING_USERNAME="admin",
                             MLFLOW_TRACKING_PASSWORD="not-the-password"))
    assert wrong.returncode == 2 and "credentials of MLFLOW_TRACKING_USERNAME=admin were refused" in wrong.stderr
    assert "not-the-password" not in wrong.stderr + wrong.stdout


def test_a_job_with_credentials_logs_its_run_and_writes_no_secret(mlflow_auth, tmp_path, monkeypatch):
    cfg = _job(tmp_path)
    host = mlflow_auth.uri.split("://", 1)[1]
    uri_with_password = f"http://{mlflow_auth.username}:{mlflow_auth.password}@{host}"
    p = _train(cfg, _env(tmp_path, **mlflow_auth.credentials), f"tracking.uri={uri_with_password}")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["status"] == "finished" and summary["mlflow_run_id"]

    # The run is there, with its metrics, for a client with the same credentials.
    for k, v in mlflow_auth.credentials.items():
        monkeypatch.setenv(k, v)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_auth.uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and "train/loss" in run.data.metrics
    # The secrets it was given were used, and are masked wherever they were written.
    assert "env profile for 1 workers, cpu (gloo): HF_TOKEN=*** (cluster.env)" in out
    assert f"at http://admin:***@{host}" in out
    params = run.data.params
    assert params["cluster.env.HF_TOKEN"] == "***" and params["tracking.uri"] == f"http://admin:***@{host}"
    secrets = [FAKE_TOKEN, mlflow_auth.password]
    assert not [s for s in secrets if s in out], "a secret in the job's output"
    assert not [f"{k}={v}" for k, v in {**params, **run.data.tags}.items() if any(s in v for s in secrets)]
    arts = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "downloaded")))
    assert (arts / "config" / "resolved.yaml").is_file() and (arts / "health" / "preflight.json").is_file()
    assert "HF_TOKEN: '***'" in (arts / "config" / "resolved.yaml").read_text()
    assert not _files_holding(arts, secrets)
    # ... nor anywhere on the server (its store: params and tags; its artifacts: the model too) or in storage.
    assert not _files_holding(mlflow_auth.dir, secrets)
    assert not _files_holding(tmp_path / "runs", secrets)


def test_the_launcher_forwards_credentials_to_workers_and_logs_none(monkeypatch, capfd):
    from rayspeed.config.load import load
    from rayspeed.logs import setup
    from rayspeed.train.launch import worker_env

    setup()
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "pw-for-the-workers-123")
    cfg = load(str(ROOT / "configs" / "tiny-cpu.yaml"), [f"cluster.env={{HF_TOKEN: {FAKE_TOKEN}}}"])
    env = worker_env(cfg, "/tmp/local-storage", embedded=False)
    assert env["MLFLOW_TRACKING_USERNAME"] == "alice" and env["MLFLOW_TRACKING_PASSWORD"] == "pw-for-the-workers-123"
    assert env["HF_TOKEN"] == FAKE_TOKEN  # the values themselves reach the workers
    err = capfd.readouterr().err
    assert "HF_TOKEN=*** (cluster.env)" in err
    assert FAKE_TOKEN not in err and "pw-for-the-workers-123" not in err and "MLFLOW_TRACKING" not in err
