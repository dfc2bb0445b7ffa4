"""Where a job's files live: the launch home, the storage root, the tracking store, node-local staging and the
caches, and the names of the files in a run's directory. Torch-free, MLflow-free.

    <storage>/<job>/                       the experiment directory (Ray Train's run directory as well)
        checkpoint_stepNNNNNNNN/           one checkpoint (rayspeed.checkpoint.manifest)
        summary.json                       SUMMARY: what the launcher writes at the end
        mlflow_run.json                    DEFERRED_RUN: the run rank 0 created when the server was down at launch
        .resilience/                       RESILIENCE_DIR: events.jsonl, handled.jsonl, progress.json
        .chaos/                            CHAOS_DIR: one marker per drill that fired
        model/                             MODEL_DIR: the export, when it could not go to MLflow
    <storage>/.cache/data, .cache/models   DATA_CACHE, MODEL_CACHE (local or NFS storage)
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

AUTO = "auto"
SUMMARY = "summary.json"
DEFERRED_RUN = "mlflow_run.json"
RESILIENCE_DIR = ".resilience"
CHAOS_DIR = ".chaos"
MODEL_DIR = "model"
DATA_CACHE = ".cache/data"
MODEL_CACHE = ".cache/models"
RUNS_DIR = "runs"
RETRAIN_STATE = "runs/.retrain"
MLFLOW_DB = "mlflow.db"
ARTIFACTS_DIR = "mlartifacts"


def home() -> Path:
    """The repository the job was launched from. `make submit` passes RAYSPEED_HOME because `ray job submit
    --working-dir` runs the driver from a temporary copy whose files vanish."""
    env = os.environ.get("RAYSPEED_HOME")
    if env:
        return Path(env).expanduser().resolve()
    return Path(__file__).resolve().parents[2]


def _working_dir_copy(path: Path) -> bool:
    """Whether `path` lies in a copy Ray made for `ray job submit --working-dir` (deleted with the job)."""
    return any(part in ("runtime_resources", "working_dir_files") for part in path.parts)


def guessed_locations(cfg: Any) -> list[str]:
    """The keys whose `auto` falls back to the launch home (storage.path; tracking.uri when MLFLOW_TRACKING_URI is
    not set either)."""
    keys = []
    if cfg.storage.path == AUTO:
        keys.append("storage.path")
    if cfg.tracking.uri == AUTO and not os.environ.get("MLFLOW_TRACKING_URI"):
        keys.append("tracking.uri")
    return keys


def auto_home_problem(cfg: Any, nodes: int, package_root: Path | None = None) -> str | None:
    """Why `auto` must not guess where this job's files go, or None when the guess is safe: the job may span more
    than one node (a folder next to the launcher is not seen by the others), or the launch home is a Ray Jobs
    working-dir copy or an installed package rather than a checkout, and RAYSPEED_HOME does not say otherwise."""
    keys = guessed_locations(cfg)
    if not keys:
        return None
    fix = ("set storage.path to a folder every node sees (NFS) or an object-store URI, and tracking.uri (or "
           "MLFLOW_TRACKING_URI) to an MLflow server every node reaches; see docs/MULTINODE.md")
    if nodes > 1 or cfg.cluster.num_nodes > 1:
        return (f"{' and '.join(keys)}: auto would put checkpoints and the MLflow store next to the launcher "
                f"({home()}), which the other {max(nodes, cfg.cluster.num_nodes) - 1} node(s) do not see; {fix}")
    if os.environ.get("RAYSPEED_HOME"):
        return None
    here = package_root or Path(__file__).resolve().parents[2]  # (tests give another one)
    if _working_dir_copy(here):
        return (f"{' and '.join(keys)}: auto would write into {here}, the temporary copy "
                "`ray job submit --working-dir` made (deleted with the job); pass RAYSPEED_HOME "
                "(what `make submit` does) or " + fix)
    if not (here / "platform" / "rayspeed").is_dir():
        return (f"{' and '.join(keys)}: auto needs a rayspeed checkout or RAYSPEED_HOME to put runs in, and the "
                f"package is installed at {Path(__file__).resolve().parent}; set RAYSPEED_HOME or " + fix)
    return None


def is_uri(path: Any) -> bool:
    """True for 'scheme://...' other than file:// (those are local paths)."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def storage_path(cfg: Any) -> str:
    """storage.path resolved: a local absolute path or an object-store URI (auto: <home>/runs)."""
    if cfg.storage.path != AUTO:
        p = cfg.storage.path
        return p if "://" in p else str(Path(p).expanduser())
    return str(home() / RUNS_DIR)


def tracking_uri(cfg: Any) -> str:
    """tracking.uri resolved: the key, else MLFLOW_TRACKING_URI, else the SQLite store at <home>/mlflow.db."""
    if cfg.tracking.uri != AUTO:
        return cfg.tracking.uri
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{home() / MLFLOW_DB}"


def artifact_root(uri: str | None = None) -> str:
    """Artifact root for experiments rayspeed creates in a local store: beside the SQLite database (a store given
    as sqlite:////data/mlflow.db keeps its artifacts in /data/mlartifacts), else in the launch home."""
    if uri and uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):])
        if db.is_absolute():
            return (db.parent / ARTIFACTS_DIR).as_uri()
    return (home() / ARTIFACTS_DIR).as_uri()


def staging_root(configured: str = AUTO) -> Path:
    """Node-local folder for checkpoints on their way to / from an object store: storage.staging_dir, else
    $RAYSPEED_STAGING, else <tmp>/rayspeed-staging. Must be on a local disk with room for one checkpoint."""
    if configured and configured != AUTO:
        return Path(configured).expanduser()
    env = os.environ.get("RAYSPEED_STAGING")
    return Path(env).expanduser() if env else Path(tempfile.gettempdir()) / "rayspeed-staging"


def data_cache_dir(storage: str, staging_dir: str, job: str) -> str:
    """Where the tokenized data (a local memmap) is cached when data.cache_dir is auto: next to the runs on a
    local/NFS storage path, else in the node's staging folder (a memmap cannot live in a bucket)."""
    if not is_uri(storage):
        return str(Path(storage) / DATA_CACHE)
    return str(staging_root(staging_dir) / job / DATA_CACHE)


def model_cache_dir(storage: str) -> str | None:
    """Where downloaded registered models are cached: beside the runs on local/NFS storage, else the default."""
    return None if is_uri(storage) else str(Path(storage) / MODEL_CACHE)


def chaos_marker(kind: str, rank: int, step: int) -> str:
    """A drill's marker, relative to the experiment directory (the restarted rank may run on another node)."""
    return f"{CHAOS_DIR}/{kind}_rank{rank}_step{step}"


def owned_scratch(prefix: str) -> str:
    """A new temporary folder named after this host and process (`<prefix><host>-<pid>-XXXX`).

    Its user deletes it once done; a process killed on the way (a cut node, a kill drill, an OOM kill) cannot, so the
    next caller with the same prefix on this host deletes the folders whose process is gone. A long-lived node that
    runs many jobs keeps none of them."""
    import shutil
    import socket

    host = socket.gethostname().replace("-", "_")[:40] or "host"
    base = tempfile.gettempdir()
    for p in Path(base).glob(f"{prefix}{host}-*-*"):
        pid = p.name[len(prefix) + len(host) + 1 :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{prefix}{host}-{os.getpid()}-", dir=base)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True
