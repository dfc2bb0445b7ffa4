"""The job's model in MLflow (real SQLite store): a logged model in Hugging Face format with its tokenizer, linked
to the run, registered; the version loads in transformers (same logits) and in mlflow.pyfunc (text generation),
still warm-starts (its rayspeed export rides along), and `rayspeed export <run id>` writes it out. Plus the
experiment kind, the run description and the git commit tags."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

SEQ = 16


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSPEED_HOME", str(tmp_path))  # no .git there: the commit comes from the env var
    monkeypatch.setenv("RAYSPEED_GIT_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def _job(home):
    from rayspeed.config.load import parse

    return parse({"name": "hfjob", "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                                             "ffn_hidden_size": 64, "seq_len": SEQ, "tie_embeddings": False,
                                             "architecture": "Qwen2ForCausalLM"},
                  "parallel": {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 0, "micro_batch_size": 1, "grad_accum": 1},
                  "tracking": {"uri": f"sqlite:///{home}/mlflow.db"}, "cluster": {"num_workers": 1}})


def _ids():
    return torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(8))


def test_logged_model_registered_loads_in_transformers_and_pyfunc(home, tmp_path, capsys):
    import mlflow
    from transformers import AutoModelForCausalLM

    from rayspeed.model.export import export_model
    from rayspeed.model.transformer import Transformer
    from rayspeed.model.warm_start import find_model_dir, read_model_config
    from rayspeed.tracking.hf_model import job_tokenizer, log_and_register_hf
    from rayspeed.tracking.runs import find_or_create_run

    cfg = _job(home)
    uri = cfg.tracking.uri
    run_id, resumed = find_or_create_run(cfg)
    assert not resumed
    client = mlflow.MlflowClient(uri)
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    assert run.data.tags["mlflow.source.git.commit"] == "0123456789abcdef0123456789abcdef01234567"
    assert "dp=1 tp=1 pp=1 ZeRO-0" in run.data.tags["mlflow.note.content"]
    assert "\n" not in run.data.tags["mlflow.note.content"]
    # the MLflow UI's "Source" column
    assert (run.data.tags["mlflow.source.name"], run.data.tags["mlflow.source.type"]) == ("jobs/train.py", "JOB")

    model = Transformer(cfg.model, seed=5).eval()  # Qwen2-style: q/k/v biases (zero at init: make them count)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
        expected = model(_ids())
    export_dir = export_model(model, cfg, str(tmp_path / "export"))
    version = log_and_register_hf(uri, run_id, export_dir, "rayspeed-hfjob", {"val/loss": 1.5},
                                  tokenizer=job_tokenizer("bytes", None, for_serving=True))
    assert version == "1"
    said = capsys.readouterr().err  # MLflow's own echo of the registration is not repeated beside rayspeed's line
    assert "already exists" not in said and "Created version" not in said, said

    mlflow.set_tracking_uri(uri)  # restored after the test by conftest
    mlflow.set_registry_uri(uri)
    logged = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list",
                                         filter_string=f"source_run_id = '{run_id}'")
    assert len(logged) == 1
    mv = client.get_model_version("rayspeed-hfjob", "1")
    assert mv.source == f"models:/{logged[0].model_id}" and mv.run_id == run_id
    assert mv.tags["metric.val/loss"] == "1.5" and mv.tags["rayspeed.job"] == "hfjob"
    linked = json.loads(client.get_logged_model(logged[0].model_id).tags["mlflow.modelVersions"])
    assert [(d["name"], str(d["version"])) for d in linked] == [("rayspeed-hfjob", "1")]
    assert "model/weights.pt" in [a.path for a in client.list_artifacts(run_id, "model")]  # the earlier form

    local = mlflow.artifacts.download_artifacts("models:/rayspeed-hfjob/1", dst_path=str(tmp_path / "dl"))
    # the byte tokenizer's EOS (byte 0, which training appends) is the model's; weights readable as any file
    assert json.loads(Path(local, "model", "config.json").read_text())["eos_token_id"] == 0
    assert json.loads(Path(local, "model", "generation_config.json").read_text())["eos_token_id"] == 0
    weights = (tmp_path / "export-hf-check")
    from rayspeed.model.hf_export import hf_dir_from_export

    hf_dir_from_export(export_dir, str(weights))
    umask = os.umask(0)
    os.umask(umask)
    assert (weights / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    license_text = Path(local, "LICENSE.txt").read_text()
    assert "trained by rayspeed" in license_text and "huggingface.co/" not in license_text, license_text
    hf = AutoModelForCausalLM.from_pretrained(f"{local}/model", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(_ids()).logits, expected, rtol=1e-5, atol=1e-5)
    # A registered version still warm-starts: its rayspeed export is found where the warm start looks.
    assert read_model_config(str(find_model_dir(Path(local))))["architecture"] == "Qwen2ForCausalLM"

    generate = mlflow.pyfunc.load_model("models:/rayspeed-hfjob/1")
    out = generate.predict(["def main("])
    assert isinstance(out, list) and len(out) == 1 and isinstance(out[0], str) and len(out[0]) > 0

    from rayspeed.cli import main as _cli

    def export_main(argv):
        return _cli(["export", *argv])


    assert export_main([run_id, "--format", "hf", str(tmp_path / "out"), "--tracking-uri", uri]) == 0
    assert "logged model" in capsys.readouterr().out
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(_ids()).logits, expected, rtol=1e-5, atol=1e-5)
    # A registered version exports its own logged model (a run that registered twice has two).
    assert export_main(["models:/rayspeed-hfjob/1", "--format", "hf", str(tmp_path / "v1"), "--tracking-uri", uri]) == 0
    assert f"logged model {logged[0].model_id}" in capsys.readouterr().out
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "v1"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(_ids()).logits, expected, rtol=1e-5, atol=1e-5)
    assert export_main(["models:/rayspeed-hfjob/9", "--format", "hf", str(tmp_path / "v9"), "--tracking-uri", uri]) == 2
    assert "no such registered version" in capsys.readouterr().err and not (tmp_path / "v9").exists()
    assert export_main(["0" * 32, "--format", "hf", str(tmp_path / "o2"), "--tracking-uri", uri]) == 2
    assert "no such MLflow run" in capsys.readouterr().err


def test_run_resumed_gets_this_attempts_plan(home):
    import mlflow

    from rayspeed.tracking.runs import find_or_create_run

    cfg = _job(home)
    first, _ = find_or_create_run(cfg)
    cfg.train.max_steps = 77
    again, resumed = find_or_create_run(cfg)
    assert resumed and again == first
    assert "77 steps" in mlflow.MlflowClient(cfg.tracking.uri).get_run(first).data.tags["mlflow.note.content"]


def test_git_commit_prefers_the_checkout(tmp_path, monkeypatch):
    import subprocess

    from rayspeed.tracking.hf_model import git_commit

    monkeypatch.setenv("RAYSPEED_GIT_COMMIT", "from-env")
    assert git_commit(str(tmp_path)) == "from-env"
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.email=a@b", "-c", "user.name=t", "commit", "-q",
                    "--allow-empty", "-m", "x"], check=True)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert git_commit(str(tmp_path)) == head.strip()
    monkeypatch.delenv("RAYSPEED_GIT_COMMIT")
    assert git_commit(str(tmp_path / "nowhere")) is None


def test_a_sqlite_store_elsewhere_keeps_its_artifacts_beside_it(home, tmp_path, monkeypatch):
    import mlflow

    from rayspeed.config.load import parse
    from rayspeed.tracking.runs import find_or_create_run

    store = tmp_path / "elsewhere"
    store.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}/mlflow.db")
    cfg = parse({"name": "beside", "cluster": {"num_workers": 1}})
    run_id, _ = find_or_create_run(cfg)
    run = mlflow.MlflowClient(f"sqlite:///{store}/mlflow.db").get_run(run_id)
    assert run.info.artifact_uri.startswith((store / "mlartifacts").as_uri()), run.info.artifact_uri
    assert not (home / "mlartifacts").exists()
