"""A new SQLite tracking store is a copy of a prepared one (rayspeed.tracking.sqlite_store): the same schema as
MLflow's own migrations give, no migrations run, an existing store never replaced (real MLflow)."""

import logging
import sqlite3

from rayspeed.tracking.client import mlflow_client


def _schema(db):
    with sqlite3.connect(db) as conn:
        # Each statement's lines as a set: Alembic's batch migrations order a table's constraints as a Python set
        # iterates, so two runs of MLflow's own migrations can differ in that order only.
        tables = sorted(sorted(line.strip().rstrip(",") for line in r[0].splitlines())
                        for r in conn.execute("SELECT sql FROM sqlite_master WHERE sql IS NOT NULL"))
        version = conn.execute("SELECT version_num FROM alembic_version").fetchall()
    conn.close()
    return tables, version


class _Heard(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_new_store_is_the_prepared_copy_with_mlflow_s_schema_and_no_migrations(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    own = tmp_path / "own.db"
    MlflowClient(f"sqlite:///{own}").search_experiments()  # MLflow's migrations, for the comparison
    mlflow_client(f"sqlite:///{tmp_path / 'first.db'}").search_experiments()  # makes the prepared store
    heard, mlflow_db_log = _Heard(), logging.getLogger("mlflow.store.db.utils")  # MLflow's loggers do not propagate
    mlflow_db_log.addHandler(heard)
    try:
        client = mlflow_client(f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}")
        exp = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
        run = client.create_run(exp)
        client.log_metric(run.info.run_id, "loss", 1.5, step=3)
    finally:
        mlflow_db_log.removeHandler(heard)
    assert not [m for m in heard.messages if "database tables" in m]  # no migration ran
    assert _schema(tmp_path / "new" / "mlflow.db") == _schema(own)
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [1.5]
    # The default experiment is this process's, as MLflow makes it, not the folder the copy was prepared in.
    default = client.get_experiment("0")
    assert default.name == "Default" and default.artifact_location == MlflowClient(
        f"sqlite:///{own}").get_experiment("0").artifact_location


def test_an_existing_store_is_never_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow_client(uri)
    exp = client.create_experiment("kept", artifact_location=(tmp_path / "art").as_uri())
    assert mlflow_client(uri).get_experiment(exp).name == "kept"
