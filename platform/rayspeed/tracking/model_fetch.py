"""Where `train.init_from` points, as a local directory: a registered version or another MLflow URI is
downloaded once per machine into a per-version cache (versions are immutable, so a cached copy is reused; an
alias is resolved to its version first). Several ranks on one machine download once (fcntl lock)."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from rayspeed.model.warm_start import COMPLETE, CONFIG, WarmStartError, find_model_dir
from rayspeed.tracking.client import mlflow_client

log = logging.getLogger(__name__)

_MODELS_RE = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))/?$")


def default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "rayspeed", "models")


def parse_models_uri(spec: str) -> Optional[tuple[str, Optional[str], Optional[str]]]:
    """models:/name@alias -> (name, alias, None); models:/name/3 -> (name, None, "3"); anything else -> None."""
    m = _MODELS_RE.match(spec.strip())
    if not m:
        return None
    return m.group("name"), m.group("alias"), m.group("version")


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s)[:80]


def resolve_alias(spec: str, tracking_uri: Optional[str]) -> str:
    """models:/name@alias -> models:/name/<version> (unchanged for every other spec)."""
    parsed = parse_models_uri(spec)
    if not parsed or not parsed[1]:
        return spec
    name, alias, _ = parsed
    from mlflow.exceptions import MlflowException

    try:
        mv = mlflow_client(tracking_uri).get_model_version_by_alias(name, alias)
    except MlflowException as e:
        raise WarmStartError(f"train.init_from: {spec}: no version of {name!r} carries the alias {alias!r} in "
                             f"{tracking_uri or 'the default MLflow store'} ({str(e).splitlines()[0][:200]})") from None
    return f"models:/{name}/{mv.version}"


def init_from_problem(spec: str, tracking_uri: Optional[str]) -> Optional[str]:
    """The launcher's check of train.init_from, before anything is written: a local folder that is not there or
    is no rayspeed export, or a models:/ name, alias or version the registry answers it does not have, is one line
    naming the key; a registry that does not answer is not (bad luck: the workers try again). Downloads nothing."""
    spec = str(spec).strip()
    if "://" not in spec and not spec.startswith(("models:/", "runs:/")):
        try:
            resolve_init_from(spec, tracking_uri)
        except WarmStartError as e:
            return str(e)
        return None
    parsed = parse_models_uri(spec)
    if parsed is None:
        return None
    name, alias, version = parsed
    from rayspeed.tracking.client import one_try, unreachable

    if unreachable(str(tracking_uri or "")):
        return None
    where = tracking_uri or "the default MLflow store"
    what = f"no version of {name!r} carries the alias {alias!r}" if alias else f"{name!r} has no version {version}"
    problem = (f"train.init_from: {spec}: {what} in {where}; check the registered model's name and its aliases or "
               "versions in the MLflow UI (Models), or point at an exported model folder")
    db = str(tracking_uri or "")
    if db.startswith("sqlite:///") and not os.path.exists(db[len("sqlite:///"):]):
        return problem  # no store yet, so no registered model (and opening one would create it)
    if not db.startswith(("sqlite:", "http://", "https://", "databricks")):
        return None  # a file store (or a plugin): opening it may create folders; the workers' fetch says why
    try:
        with one_try(10.0):
            client = mlflow_client(tracking_uri)
            if alias:
                client.get_model_version_by_alias(name, alias)
            else:
                client.get_model_version(name, str(version))
    except Exception as e:
        if getattr(e, "error_code", "") not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        return problem
    return None


def resolve_init_from(spec: str, tracking_uri: Optional[str] = None, cache_dir: Optional[str] = None) -> str:
    """The local directory of the model `spec` names (see the module doc); downloads it if needed.

    Raises WarmStartError with the reason (no such directory, no such alias/version, download failed, no
    model_config.json in what was downloaded)."""
    if not spec or not str(spec).strip():
        raise WarmStartError("train.init_from: empty")
    spec = str(spec).strip()
    if "://" not in spec and not spec.startswith(("models:/", "runs:/")):
        p = Path(spec).expanduser()
        if not p.is_dir():
            raise WarmStartError(f"train.init_from: {spec}: no such directory (expected an exported rayspeed model "
                                 "with weights.pt and model_config.json, or a models:/ URI)")
        found = find_model_dir(p)
        if found is None:
            raise WarmStartError(f"train.init_from: {spec}: no {CONFIG} in it (not a rayspeed model export)")
        return str(found.resolve())

    concrete = resolve_alias(spec, tracking_uri)
    parsed = parse_models_uri(concrete)
    if parsed:
        key = f"{_safe(parsed[0])}/v{parsed[2]}"
    else:
        key = f"uri/{hashlib.sha256(concrete.encode()).hexdigest()[:24]}"
    # The store the name lives in is part of the key: two stores can both have a version 1 of a name.
    store = hashlib.sha256(str(tracking_uri or "").encode()).hexdigest()[:12]
    root = Path(cache_dir or default_cache_dir()).expanduser() / store
    final = root / key
    if (final / COMPLETE).exists():
        found = find_model_dir(final)
        if found is not None:
            return str(found)
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(str(final) + ".lock", "a") as lf:  # ranks on one machine: one downloads, the others wait
        fcntl.flock(lf.fileno(), fcntl.LOCK_EX)
        try:
            if not (final / COMPLETE).exists():
                _download(concrete, spec, tracking_uri, final)
        finally:
            fcntl.flock(lf.fileno(), fcntl.LOCK_UN)
    found = find_model_dir(final)
    if found is None:
        raise WarmStartError(f"train.init_from: {spec}: the download holds no {CONFIG} (not a rayspeed model)")
    return str(found)


def _download(uri: str, spec: str, tracking_uri: Optional[str], final: Path) -> None:
    import mlflow.artifacts

    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", suffix=".tmp", dir=str(final.parent)))
    try:
        try:
            source = uri
            parsed = parse_models_uri(uri)
            if parsed:
                # MLflow resolves models:/ URIs against the process-wide registry URI, not the one passed to
                # download_artifacts: look the version's files up in *this* store, then download those.
                source = mlflow_client(tracking_uri).get_model_version_download_uri(parsed[0], parsed[2])
            mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(tmp), tracking_uri=tracking_uri,
                                                registry_uri=tracking_uri)
        except Exception as e:
            raise WarmStartError(f"train.init_from: {spec}: download of {uri} failed "
                                 f"({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''})") from None
        if find_model_dir(tmp) is None:
            raise WarmStartError(f"train.init_from: {spec}: {uri} holds no {CONFIG} (not a rayspeed model export)")
        (tmp / COMPLETE).write_text(uri + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        log.info("warm start: downloaded %s to %s", uri, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
