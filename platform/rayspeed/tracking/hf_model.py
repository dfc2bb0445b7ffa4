"""The job's model in MLflow as a Hugging Face model: an MLflow 3 logged model (transformers flavor, task
text-generation, with its tokenizer), linked to the run and registered as a version of `tracking.register_model`.

    version = log_and_register_hf(uri, run_id, export_dir, "rayspeed-tiny", {"val/loss": 1.2}, tokenizer)
    transformers.AutoModelForCausalLM.from_pretrained(<version download>/model)   # or
    mlflow.pyfunc.load_model("models:/rayspeed-tiny/1").predict(["def f("])

The logged model also carries the rayspeed export it was converted from under `rayspeed/` (weights.pt and
model_config.json), so a registered version still warm-starts through `train.init_from: models:/...` and the
retraining cycle reads it as before. The run keeps the export under its `model/` artifact too (the form of
earlier versions). Run metadata set here: the run description (`mlflow.note.content`), the git commit
(`mlflow.source.git.commit`) and the experiment kind of experiments rayspeed creates.

Tracking never fails the job: every call is bounded in time, retried, and returns None when it gave up.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Optional

from rayspeed.compat import mlflow_process_store
from rayspeed.tracking.client import mlflow_client
from rayspeed.tracking.registry import MODEL_ARTIFACT, bounded, metric_tags

log = logging.getLogger(__name__)

LOGGED_MODEL_NAME = "model"
RAYSPEED_SUBDIR = "rayspeed"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
GIT_COMMIT_TAG = "mlflow.source.git.commit"
GIT_COMMIT_ENV = "RAYSPEED_GIT_COMMIT"
NOTE_TAG = "mlflow.note.content"
_REGISTRATION_ECHO = re.compile(r"^(Registered model '.*' already exists\. Creating a new version|Successfully "
                                r"registered model '.*'\.$|Created version '\d+' of model )")


def git_commit(repo: Optional[str] = None) -> Optional[str]:
    """The commit of the checkout the job runs from: `git rev-parse HEAD` where the tree has .git, else
    RAYSPEED_GIT_COMMIT (`make submit` passes it: `ray job submit --working-dir` copies no .git)."""
    from rayspeed.paths import home

    root = Path(repo) if repo else home()
    if (root / ".git").exists():
        try:
            r = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                               timeout=10)
            if r.returncode == 0 and r.stdout.strip():
                return r.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return os.environ.get(GIT_COMMIT_ENV) or None


SOURCE_NAME_TAG = "mlflow.source.name"
SOURCE_TYPE_TAG = "mlflow.source.type"


def run_tags(plan_line: Optional[str] = None) -> dict[str, str]:
    """Tags for the job's run: the plan as its description, the entry point and the git commit as its source
    (the MLflow UI's "Source" column)."""
    tags = {SOURCE_NAME_TAG: "jobs/train.py", SOURCE_TYPE_TAG: "JOB"}
    if plan_line:
        tags[NOTE_TAG] = plan_line
    commit = git_commit()
    if commit:
        tags[GIT_COMMIT_TAG] = commit
    return tags


def plan_line(cfg: Any) -> str:
    """The plan in one line, for the run description."""
    p, m = cfg.parallel, cfg.model
    model = m.pretrained if m.pretrained else f"{m.architecture} h{m.hidden_size} L{m.num_layers}"
    return (f"{cfg.name}: {model}, dp={p.dp} tp={p.tp} pp={p.pp} ZeRO-{p.zero_stage}, micro-batch "
            f"{p.micro_batch_size} x accumulation {p.grad_accum}, global batch {cfg.train.global_batch_size}, "
            f"{cfg.train.max_steps} steps, {cfg.train.precision}")


def job_tokenizer(data_tokenizer: str, pretrained: Optional[str], for_serving: bool) -> Any:
    """The tokenizer that goes with the model: a tokenizer.json path, the pretrained model's directory
    (data.tokenizer: model), or for the byte tokenizer nothing (files) / its transformers equivalent (serving)."""
    if data_tokenizer == "bytes":
        if not for_serving:
            return None
        from rayspeed.model.hf_export import byte_tokenizer

        return byte_tokenizer()
    if data_tokenizer == "model" and pretrained:
        from rayspeed.model.hf_weights import local_model_dir

        return local_model_dir(str(pretrained))
    return data_tokenizer


def log_hf_model(tracking_uri: str, run_id: str, hf_dir: str, export_dir: Optional[str] = None,
                 tags: Optional[dict[str, str]] = None) -> Any:
    """Log the Hugging Face directory hf_dir as the run's logged model (transformers flavor, text-generation);
    export_dir (a rayspeed export) rides along under rayspeed/. Returns mlflow's ModelInfo. Raises on failure."""
    import mlflow
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client = mlflow_client(tracking_uri)
    run = client.get_run(run_id)
    import transformers

    # Explicit requirements: MLflow's inference imports torchvision and friends, which a CPU image lacks.
    reqs = [f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}", "tokenizers",
            "safetensors"]
    # Model.log resolves the store and the experiment from the process-wide settings.
    with mlflow_process_store(tracking_uri):
        mlflow.set_experiment(experiment_id=run.info.experiment_id)
        if (Path(hf_dir) / "processor_config.json").is_file():  # a vision-language model: no flavor pipeline
            from rayspeed.tracking.image_text_model import ARTIFACT, ImageTextModel

            with tempfile.TemporaryDirectory(prefix="rayspeed-hf-") as named:
                folder = os.path.join(named, ARTIFACT)  # the artifact keeps its folder's name: artifacts/model/
                shutil.copytree(hf_dir, folder, copy_function=_link_or_copy)
                # Model.log with the pyfunc flavor: pyfunc.log_model takes no run_id (the run is not active here).
                info = mlflow.models.Model.log(artifact_path=None, flavor=mlflow.pyfunc, name=LOGGED_MODEL_NAME,
                                               run_id=run_id, python_model=ImageTextModel(),
                                               artifacts={ARTIFACT: folder},
                                               pip_requirements=[*reqs, "pillow", "pandas"], tags=tags or None)
        else:
            info = mlflow.transformers.log_model(
                {"model": AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                 "tokenizer": AutoTokenizer.from_pretrained(hf_dir)}, name=LOGGED_MODEL_NAME,
                task="text-generation", run_id=run_id, pip_requirements=reqs, model_config={"max_new_tokens": 32},
                tags=tags or None)
    if export_dir:
        client.log_model_artifacts(info.model_id, export_dir, RAYSPEED_SUBDIR)
    # MLflow's fallback LICENSE.txt sends the reader to a hub URL built from the temporary folder's path: the
    # model's own license note replaces it (the folder's files overwrite the logged ones of the same name).
    with tempfile.TemporaryDirectory(prefix="rayspeed-license-") as lic:
        Path(lic, "LICENSE.txt").write_text(license_note(run, _base_model(export_dir)), encoding="utf-8")
        client.log_model_artifacts(info.model_id, lic)
    return info


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link where the two folders share a file system (no second copy of the weights), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _base_model(export_dir: Optional[str]) -> Optional[str]:
    import json

    try:
        spec = json.loads((Path(str(export_dir)) / "model_config.json").read_text())
        return spec.get("model", {}).get("pretrained") or None
    except (OSError, ValueError, AttributeError):
        return None


def license_note(run: Any, base: Optional[str]) -> str:
    """What a reader of the logged model needs to know about its license."""
    job = run.data.tags.get("rayspeed.job", run.info.run_name)
    if base:
        origin = (f"It was fine-tuned from {base}: its license, and the license of the training data, apply to "
                  f"this model; see the base model's own LICENSE or model card"
                  + (f" (https://huggingface.co/{base})" if not base.startswith(("/", ".", "~")) else "") + ".")
    else:
        origin = ("It was trained from randomly initialised weights (no base model): the license of the training "
                  "data applies to it.")
    return (f"This model was trained by rayspeed, job {job!r}, MLflow run {run.info.run_id}.\n{origin}\n")


def register_logged_model(tracking_uri: str, info: Any, registered_name: str, run_id: str,
                          tags: dict[str, str]) -> str:
    """Register the logged model as a new version of registered_name (created if missing)."""
    from mlflow.exceptions import MlflowException

    c = mlflow_client(tracking_uri)
    try:
        c.get_registered_model(registered_name)
    except MlflowException:
        try:
            c.create_registered_model(registered_name, tags={"rayspeed.format": "hf"},
                                      description="Hugging Face causal LM trained by rayspeed; load with "
                                                  "transformers or mlflow.pyfunc")
        except MlflowException:
            c.get_registered_model(registered_name)  # created concurrently
    tags = {"rayspeed.job": c.get_run(run_id).data.tags.get("rayspeed.job", ""), **tags}
    for mv in c.search_model_versions(f"run_id = '{run_id}'"):  # a retry must not register twice
        if mv.name == registered_name and (mv.tags or {}).get("rayspeed.export_id") == tags["rayspeed.export_id"]:
            return str(mv.version)
    import mlflow

    # register_model also records the version on the logged model (mlflow.modelVersions), which the UI follows. It
    # prints "Registered model ... already exists" and "Created version ..." to stderr itself (no logger to filter):
    # rayspeed's own line says it once; anything else it writes is passed on.
    with mlflow_process_store(tracking_uri), contextlib.redirect_stderr(io.StringIO()) as said:
        mv = mlflow.register_model(info.model_uri, registered_name, tags=tags)
    for line in said.getvalue().splitlines():
        if line.strip() and not _REGISTRATION_ECHO.match(line):
            print(line, file=sys.stderr)
    c.update_model_version(registered_name, mv.version, description=f"run {run_id}")
    c.set_tag(run_id, "rayspeed.registered_version", f"{registered_name}/{mv.version}")
    c.set_tag(run_id, "rayspeed.logged_model_id", info.model_id)
    return str(mv.version)


def log_and_register_hf(tracking_uri: str, run_id: str, export_dir: str, registered_name: str,
                        metrics: Optional[dict[str, Any]] = None, tokenizer: Any = None,
                        timeout_s: float = 600.0) -> Optional[str]:
    """The end-of-job call: the export uploaded as the run's model/ artifact, converted to Hugging Face format
    with its tokenizer, logged as the run's logged model and registered. Returns the version, or None."""
    from rayspeed.model.hf_export import hf_dir_from_export

    ok, _ = bounded(lambda: mlflow_client(tracking_uri).log_artifacts(
        run_id, export_dir, MODEL_ARTIFACT), "model upload", timeout_s)
    if not ok:
        return None
    with tempfile.TemporaryDirectory(prefix="rayspeed-hf-") as tmp:
        try:
            hf_dir_from_export(export_dir, tmp, tokenizer=tokenizer)
        except Exception as e:
            log.warning("Hugging Face conversion of %s failed (%s): model not registered", export_dir, e)
            return None
        tags = metric_tags(metrics or {})
        tags.update({"rayspeed.run_id": run_id, "rayspeed.export_id": uuid.uuid4().hex})
        box: dict[str, Any] = {}

        def log_once() -> Any:
            if "info" not in box:  # retries re-register, they do not log a second model
                box["info"] = log_hf_model(tracking_uri, run_id, tmp, export_dir, tags={"rayspeed.run_id": run_id})
            return box["info"]

        ok, info = bounded(log_once, "logged model", timeout_s)
        if not ok:
            return None
        ok, version = bounded(lambda: register_logged_model(tracking_uri, info, registered_name, run_id, tags),
                              "model registration", timeout_s)
    if ok:
        log.info("registered %s version %s (logged model %s) from run %s", registered_name, version,
                 info.model_id, run_id)
    return version if ok else None
