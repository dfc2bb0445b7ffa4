"""A new SQLite tracking store starts as a copy of a prepared empty one, not through MLflow's schema migrations.

MLflow builds a new SQLite store by running every Alembic migration since its first release: 0.8 s of CPU on the
2-core demo (`MlflowClient("sqlite:///new.db")` 1.51 s against 0.75 s for an existing store), paid by the first
job of every new home, every fresh clone's `make train`, and every test with a home of its own. The prepared store
is made once per MLflow version (the same migrations, then its default experiment removed: MLflow recreates that
with the opening process's artifact root) in the user's cache folder, and copied. Anything that goes wrong here
leaves the store to MLflow, as before.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import tempfile
from pathlib import Path
from typing import Optional

log = logging.getLogger("rayspeed.tracking")

SQLITE = "sqlite:///"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rayspeed"


def prepare(uri: Optional[str]) -> None:
    """Before MLflow opens `uri`: a SQLite store that does not exist yet is created from the prepared copy."""
    if not uri or not uri.startswith(SQLITE) or uri.startswith(SQLITE + ":memory:"):
        return
    db = Path(uri[len(SQLITE):])
    if db.exists():
        return
    try:
        template = _template()
        db.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{db.name}.", dir=db.parent)
        os.close(fd)
        try:
            shutil.copyfile(template, tmp)
            os.link(tmp, db)  # never over a store another process made meanwhile: theirs is kept
        finally:
            os.unlink(tmp)
    except FileExistsError:
        pass
    except Exception as e:  # MLflow builds the store itself, as it always did
        log.debug("the prepared MLflow store was not used for %s: %s", db, e)


def _template() -> Path:
    import mlflow

    folder = cache_dir()
    template = folder / f"mlflow-{mlflow.__version__}-empty.db"
    if template.exists():
        return template
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        made = Path(work) / "store.db"
        SqlAlchemyStore(f"{SQLITE}{made}", Path(work).as_uri()).engine.dispose()
        with sqlite3.connect(made) as conn:  # the default experiment names this folder: MLflow makes it anew
            conn.execute("DELETE FROM experiment_tags")
            conn.execute("DELETE FROM experiments")
        conn.close()
        os.replace(made, template)
    return template
