"""`rayspeed export <run id | models:/name/version | checkpoint dir> --format hf|peft OUT`: a directory transformers
(or peft) loads.

  * --format peft (an adapter job): adapter_config.json + adapter_model.safetensors, which
    peft.PeftModel.from_pretrained(base, OUT) loads on the job's base; --format hf of an adapter job merges the
    adapter into the base weights re-read from model.pretrained;

  * a checkpoint dir (`<storage>/<job>/checkpoint_stepN/`, or the job's folder: its newest verified
    checkpoint) is verified against its manifest, consolidated with DeepSpeed's tools
    (rayspeed.checkpoint.consolidate) and written as config.json + safetensors + the job's tokenizer files;
  * an MLflow run id: the run's logged model (already Hugging Face format) is downloaded and its model and
    tokenizer files copied; a run from before logged models existed is converted from its `model/` artifact;
  * a registered version (`models:/name/3`, `models:/name@champion`): that version's own logged model, as for a run
    (a run that registered twice, say resubmitted for more steps, has two).

The byte tokenizer has no tokenizer files: none are written for it (ids are the text's UTF-8 bytes; pass
`--byte-tokenizer` to write an equivalent transformers tokenizer). Bad input exits 2 with one line, before OUT
is created.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from rayspeed.errors import EXIT_BAD_INPUT, EXIT_OK

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
_VERSION = re.compile(r"^models:/[^/@]+(/\d+|@[^/]+)/?$")


class ExportInputError(ValueError):
    """One line naming what is wrong with the command's input."""


def _check_out(out: str) -> Path:
    p = Path(out).expanduser()
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise ExportInputError(f"OUT {out}: exists and is not an empty directory; choose a new path")
    return p


def _from_checkpoint(args: argparse.Namespace, out: Path) -> list[str]:
    from rayspeed.checkpoint.consolidate import ConsolidateError, consolidate, find_checkpoint
    from rayspeed.checkpoint.manifest import read_manifest

    model_section = None
    if args.config:
        import dataclasses

        from rayspeed.config.load import load

        model_section = dataclasses.asdict(load(args.config, args.overrides).model)
    try:
        ckpt = find_checkpoint(args.source)
        state, model, notes = consolidate(str(ckpt), model_section)
    except ConsolidateError as e:
        raise ExportInputError(str(e)) from None
    from types import SimpleNamespace

    from rayspeed.config.shape import ModelShape
    from rayspeed.model.hf_export import write_hf_dir

    meta = read_manifest(ckpt) or {}
    shape = ModelShape.from_config(SimpleNamespace(**model))
    adapter = _adapter_section(model)
    base = meta.get("init_from") or model.get("pretrained")  # the weights the adapter was trained on
    if args.format == "peft":
        return notes + _write_peft(state, adapter, shape, base, out, str(ckpt))
    if adapter is not None:  # the checkpoint holds the adapter only: merged into the base it was trained on
        if meta.get("init_from"):
            raise ExportInputError(f"--format hf: {ckpt.name}'s adapter was trained on train.init_from "
                                   f"{meta['init_from']}'s weights; export the run id (its model is merged) or "
                                   "--format peft")
        state, merge_note = _merged_into_base(state, adapter, shape, model)
        notes.append(merge_note)
    tokenizer = _tokenizer(str(meta.get("tokenizer", "bytes")), model.get("pretrained"), args.byte_tokenizer)
    try:
        report = write_hf_dir(state, shape, str(out), tokenizer, int(args.max_shard_size * 1e9))
    except (KeyError, ValueError) as e:
        raise ExportInputError(f"{ckpt}: the weights do not fit the model section ({e})") from None
    return notes + [f"{len(report['weights'])} safetensors file(s), tokenizer: "
                    f"{', '.join(report['tokenizer']) or 'none (byte tokenizer)'}"]


def _adapter_section(model: dict[str, Any]) -> Any:
    from types import SimpleNamespace

    from rayspeed.config import adapter

    section = model.get("adapter")
    ns = SimpleNamespace(**section) if isinstance(section, dict) else None
    return ns if adapter.enabled(ns) else None


def _write_peft(state: dict[str, Any], adapter: Any, shape: Any, base: Optional[str], out: Path,
                where: str) -> list[str]:
    from rayspeed.adapters.peft_files import WEIGHTS_FILE, write_peft_dir

    if adapter is None:
        raise ExportInputError(f"--format peft: {where} is a full fine-tune (its model section has no adapter); "
                               "use --format hf")
    from rayspeed.adapters.merge import adapted_layers

    write_peft_dir(state, adapter, shape, str(out), str(base or ""))
    return [f"adapter: rank {adapter.rank} on {len(adapted_layers(state))} layers, base {base}",
            f"{WEIGHTS_FILE} + adapter_config.json"]


def _merged_into_base(state: dict[str, Any], adapter: Any, shape: Any, model: dict[str, Any]
                      ) -> tuple[dict[str, Any], str]:
    from rayspeed.adapters.merge import adapted_layers, merged
    from rayspeed.model.hf_weights import HFWeightsError, local_model_dir, read_whole

    base = model.get("pretrained")
    if not base:
        raise ExportInputError("--format hf: the adapter job has no model.pretrained to merge into")
    try:
        whole = read_whole(local_model_dir(str(base)), shape)
    except (HFWeightsError, OSError) as e:
        raise ExportInputError(f"--format hf: cannot read the base {base} to merge the adapter into ({e})") from None
    whole.update(state)  # the adapter, and what trained in full
    what = f"{len(adapted_layers(state))} adapted layers merged into {base}'s weights"
    return merged(whole, adapter, shape.family), what


def _tokenizer(setting: str, pretrained: Optional[str], byte_files: bool) -> Any:
    from rayspeed.tracking.hf_model import job_tokenizer

    return job_tokenizer(setting, pretrained, for_serving=byte_files)


def _from_run(args: argparse.Namespace, out: Path) -> list[str]:
    from mlflow.exceptions import MlflowException

    from rayspeed.compat import mlflow_process_store
    from rayspeed.paths import MLFLOW_DB, home
    from rayspeed.tracking.client import mlflow_client

    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home() / MLFLOW_DB}"
    client = mlflow_client(uri)
    try:
        run = client.get_run(args.source)
    except MlflowException:
        raise ExportInputError(f"{args.source}: no such MLflow run in {uri} (pass --tracking-uri, or give a "
                               "checkpoint directory)") from None
    import mlflow

    with mlflow_process_store(uri):
        models = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list",
                                             filter_string=f"source_run_id = '{args.source}'")
    with tempfile.TemporaryDirectory(prefix="rayspeed-export-") as tmp:
        if args.format == "peft":
            return _peft_from_run(client, args.source, Path(tmp), out)
        if models:
            model_id = sorted(models, key=lambda m: m.creation_timestamp)[-1].model_id
            return [f"run {args.source}: logged model {model_id}", *_copy_logged(uri, model_id, Path(tmp), out,
                                                                                 args.source)]
        try:
            src = Path(client.download_artifacts(args.source, "model", tmp))
        except Exception:
            raise ExportInputError(f"{args.source}: the run has no logged model and no model/ artifact (it did "
                                   "not finish?); export one of its checkpoints instead") from None
        from rayspeed.model.export import CONFIG
        from rayspeed.model.hf_export import hf_dir_from_export

        if not (src / CONFIG).is_file():
            raise ExportInputError(f"{args.source}: its model/ artifact is not a rayspeed export")
        import json

        spec = json.loads((src / CONFIG).read_text())["model"]
        tok = _tokenizer(run.data.params.get("data.tokenizer", "bytes"), spec.get("pretrained"), args.byte_tokenizer)
        report = hf_dir_from_export(str(src), str(out), tok, int(args.max_shard_size * 1e9))
        return [f"run {args.source}: converted its model/ export", f"{len(report['weights'])} safetensors file(s)"]


def _copy_logged(uri: str, model_id: str, tmp: Path, out: Path, source: str) -> list[str]:
    """A logged model's Hugging Face files (MLflow's transformers flavor keeps the tokenizer apart, under
    components/tokenizer) copied flat into OUT."""
    import mlflow

    from rayspeed.compat import mlflow_process_store

    with mlflow_process_store(uri):  # models:/ URIs resolve against the process-wide store
        src = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{model_id}", dst_path=str(tmp)))
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for sub in ("model", "components/tokenizer"):
        for f in sorted((src / sub).glob("*")) if (src / sub).is_dir() else []:
            if f.is_file():
                shutil.copy2(f, out / f.name)
                copied.append(f.name)
    if not (out / "config.json").is_file():
        raise ExportInputError(f"{source}: logged model {model_id} holds no Hugging Face model")
    return [f"copied {', '.join(copied)}"]


def _from_version(args: argparse.Namespace, out: Path) -> list[str]:
    from mlflow.exceptions import MlflowException

    from rayspeed.model.warm_start import WarmStartError
    from rayspeed.paths import MLFLOW_DB, home
    from rayspeed.tracking.client import mlflow_client
    from rayspeed.tracking.model_fetch import parse_models_uri, resolve_alias

    if args.format == "peft":
        raise ExportInputError(f"{args.source}: --format peft takes the adapter job's run id or a checkpoint")
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home() / MLFLOW_DB}"
    try:
        name, _, version = parse_models_uri(resolve_alias(args.source, uri)) or ("", None, None)
        mv = mlflow_client(uri).get_model_version(name, str(version))
    except (MlflowException, WarmStartError):  # an unknown name, version or alias
        raise ExportInputError(f"{args.source}: no such registered version in {uri} (pass --tracking-uri)") from None
    model_id = (mv.source or "").removeprefix("models:/")
    if not (mv.source or "").startswith("models:/") or "/" in model_id:
        raise ExportInputError(f"{args.source}: version {version} of {name} is no logged model ({mv.source}); "
                               f"export its run ({mv.run_id}) instead")
    with tempfile.TemporaryDirectory(prefix="rayspeed-export-") as tmp:
        return [f"{args.source}: logged model {model_id}", *_copy_logged(uri, model_id, Path(tmp), out,
                                                                          args.source)]


def _peft_from_run(client: Any, run_id: str, tmp: Path, out: Path) -> list[str]:
    from rayspeed.model.export import ADAPTER_DIR

    try:
        src = Path(client.download_artifacts(run_id, f"model/{ADAPTER_DIR}", str(tmp)))
    except Exception:
        src = None
    if src is None or not src.is_dir():
        raise ExportInputError(f"--format peft: run {run_id} logged no adapter (model/{ADAPTER_DIR}: a full "
                               "fine-tune, or it did not finish); use --format hf")
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        shutil.copy2(f, out / f.name)
    return [f"run {run_id}: its adapter (model/{ADAPTER_DIR})"]


def export_command(args: argparse.Namespace) -> int:
    from rayspeed.errors import ConfigError

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per download is noise in a log

    try:
        out = _check_out(args.out)
        src = Path(args.source).expanduser()
        if src.exists():
            lines = _from_checkpoint(args, out)
        elif _RUN_ID.match(args.source):
            lines = _from_run(args, out)
        elif _VERSION.match(args.source):
            lines = _from_version(args, out)
        else:
            raise ExportInputError(f"{args.source}: neither a directory nor an MLflow run id (32 hex digits) nor a "
                                   "registered version (models:/name/3 or models:/name@alias)")
    except (ExportInputError, ConfigError) as e:
        msg = e.render() if isinstance(e, ConfigError) else str(e)
        print(f"rayspeed export: {msg}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for line in lines:
        print(line)
    how = ("peft.PeftModel.from_pretrained(base, OUT)" if args.format == "peft"
           else "transformers.AutoModelForImageTextToText.from_pretrained, with AutoProcessor"
           if _vision_language(out) else "transformers.AutoModelForCausalLM.from_pretrained")
    print(f"wrote {out} (load with {how})")
    return EXIT_OK


def _vision_language(out: Any) -> bool:
    """The written folder holds a whole vision-language model (its config.json names a vision_config)."""
    import json

    try:
        return "vision_config" in json.loads((Path(str(out)) / "config.json").read_text())
    except (OSError, ValueError):
        return False
