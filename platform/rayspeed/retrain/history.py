"""A retraining cycle's bookkeeping: <storage>/.retrain/<name>.json holds the history of cycles, the data hash of the
last cycle that trained and the champion it left."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from rayspeed import paths
from rayspeed.redact import redact_uri

log = logging.getLogger("rayspeed.retrain")

HISTORY_KEEP = 50


def state_dir(storage: str) -> Path:
    if paths.is_uri(storage):  # remote storage: the cycle's bookkeeping stays with the repository
        return paths.home() / paths.RETRAIN_STATE
    return Path(storage) / ".retrain"


def uri_key(uri: str) -> str:
    """How the state file names the MLflow store: the URI without its credentials (never written in clear)."""
    return redact_uri(uri)


def read_state(path: Path) -> dict[str, Any]:
    try:
        with open(path) as fh:
            d = json.load(fh)
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def write_state(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state, indent=2, default=str))
    os.replace(tmp, path)


def record(state_file: Path, result: Any, started: float, trained: bool, uri: str) -> None:
    """History for every cycle; last_data_hash only for cycles that trained and decided (a failed cycle retries
    the same data next time)."""
    state = read_state(state_file)
    entry = {k: v for k, v in result.to_json().items() if v is not None}
    entry["started"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
    hist = state.get("history") or []
    hist.append(entry)
    state["history"] = hist[-HISTORY_KEEP:]
    if trained and result.outcome in ("promoted", "rejected"):
        state["last_data_hash"] = result.data_hash
        state["tracking_uri"], state["registered_model"] = uri_key(uri), result.registered_model
        state["last_cycle"] = entry
    if result.champion_after is not None:
        state["champion"] = result.champion_after
    try:
        write_state(state_file, state)
    except OSError as e:
        log.warning("could not write %s: %s", state_file, e)
