"""The shipped examples' prepared inputs (a model, a corpus) live in the repository's runs/examples/, made by
`make examples`: a job file that names a missing one is told the command, not just that the path is missing."""

from __future__ import annotations

EXAMPLES_DIR = "runs/examples"


def prepare_hint(path: str) -> str:
    """A suffix for a 'no such file' message when `path` is one of the examples' inputs, else ''."""
    if f"{EXAMPLES_DIR}/" in str(path).replace("\\", "/"):
        return f"; it is an input of a shipped example: `make examples` (in the repository) makes {EXAMPLES_DIR}/"
    return ""
