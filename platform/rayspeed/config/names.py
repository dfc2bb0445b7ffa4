"""The job's name and its registered model's: they name folders, MLflow runs and models:/ URIs."""

from __future__ import annotations

import re

from rayspeed.config.schema import AUTO

# File names are at most 255 bytes on every common filesystem; the job's folders add suffixes (.superseded-...).
MAX_NAME_BYTES = 200
_RESERVED_NAME_RE = re.compile(r"\.superseded-")
# MLflow's rule for registered model names (they appear in models:/<name>/<version> URIs).
_REGISTERED_RE = re.compile(r"[^/:]+")


def name_problems(name: str) -> list[str]:
    """The job name names folders, MLflow runs and registered models: checked here, not when the folder is made."""
    why = "it names the job's folders, its MLflow run and its registered model"
    if not name:
        return [f"name: must not be empty ({why})"]
    if not (name[0].isascii() and name[0].isalnum()):
        return [f"name: {name!r} must start with an ASCII letter or digit (not {name[0]!r}: {why})"]
    bad = sorted({ch for ch in name if not (ch.isascii() and (ch.isalnum() or ch in "._-"))})
    if bad:
        return [f"name: {name!r} may hold only ASCII letters, digits, '.', '_' and '-' (found "
                f"{', '.join(repr(b) for b in bad)}; {why})"]
    if len(name.encode()) > MAX_NAME_BYTES:
        return [f"name: {len(name.encode())} bytes; at most {MAX_NAME_BYTES} ({why}, and with its suffixes it must "
                "stay a valid file name)"]
    if _RESERVED_NAME_RE.search(name):
        return [f"name: {name!r} looks like a job set aside by --fresh (<name>.superseded-<time>); choose another"]
    return []


def registered_name_problems(name: str) -> list[str]:
    if name == AUTO or _REGISTERED_RE.fullmatch(name):
        return []
    return [f"tracking.register_model: {name!r} may not contain '/' or ':' or be empty (MLflow's rule for registered "
            "model names: they appear in models:/<name>/<version>)"]
