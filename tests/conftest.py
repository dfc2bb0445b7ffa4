import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every Ray cluster in the tests runs with token auth, like `make up`. Ray reads this when imported.
os.environ.setdefault("RAY_AUTH_MODE", "token")
# The tests' MLflow servers track runs; MLflow's job runner (three huey consumer processes per server, for its GenAI
# jobs) would only take CPU from the training processes beside them.
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")


@pytest.fixture(scope="session", autouse=True)
def _mlflow_store_template(tmp_path_factory):
    """Where the session's empty MLflow store is made, on first use (tests/_cluster.py seed_store)."""
    from _cluster import StoreTemplate

    StoreTemplate.root = tmp_path_factory.mktemp("mlflow-template")
    yield


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """A real local Ray cluster shared by every integration test of the session."""
    from _cluster import RayHead

    head = RayHead(tmp_path_factory.mktemp("ray-head"), num_cpus=8)
    yield head
    head.stop()


@pytest.fixture(scope="session")
def zero2_reference(ray_head, tmp_path_factory):
    """The uninterrupted run the kill drills compare with: tiny-cpu, 2 workers under Ray Train, ZeRO-2, 30 steps,
    every step's train/loss (tests/_cluster.py ZERO2_REFERENCE). Made once per session: checkpoint cadence,
    validation and the drills' chaos keys change no loss, so each drill's curve must equal this one."""
    from _cluster import ZERO2_REFERENCE, metric_history, run_job

    home = tmp_path_factory.mktemp("zero2-reference")
    r, summary = run_job(home, [*ZERO2_REFERENCE, "--set", "name=uninterrupted"], ray_head.address)
    assert r.returncode == 0 and summary["restarts"] == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return dict(metric_history(home, summary["mlflow_run_id"], "train/loss"))


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3 API (moto's server) for the session, its endpoint and dummy credentials in os.environ while it
    runs. Skips (with the reason) only when moto is not installed or its server cannot start."""
    try:
        import boto3  # noqa: F401
        import moto  # noqa: F401
    except ImportError as e:
        pytest.skip(f"moto[server] is not installed ({e}); pip install -e '.[test]'")
    from _moto import MotoS3

    try:
        server = MotoS3(str(tmp_path_factory.mktemp("moto") / "moto.log"))
    except RuntimeError as e:
        pytest.skip(f"moto_server could not start: {e}")
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture(scope="session")
def mlflow_auth(tmp_path_factory):
    """A real MLflow server with basic authentication for the session (tests/_mlflow_auth.py). Skips (with the
    reason) only when mlflow[auth] (Flask-WTF) is not installed."""
    try:
        import flask_wtf  # noqa: F401
    except ImportError as e:
        pytest.skip(f"mlflow[auth] is not installed ({e}); pip install -e '.[test]'")
    from _mlflow_auth import MlflowAuthServer

    server = MlflowAuthServer(tmp_path_factory.mktemp("mlflow-auth"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _mlflow_process_store_restored():
    """No test leaves MLflow's process-wide tracking/registry URI or active experiment behind for the next one
    (mlflow.set_tracking_uri also exports MLFLOW_TRACKING_URI, which rayspeed itself reads)."""
    from rayspeed.compat import MLFLOW_PROCESS_ENV

    env = {k: os.environ.get(k) for k in MLFLOW_PROCESS_ENV}
    if "mlflow" in sys.modules:
        from rayspeed.compat import mlflow_process_state

        with mlflow_process_state():
            yield
        return
    yield
    if "mlflow" in sys.modules:  # imported by this test: back to MLflow's defaults
        from mlflow.tracking import fluent
        from mlflow.tracking._model_registry import utils as registry_utils
        from mlflow.tracking._tracking_service import utils as tracking_utils

        tracking_utils._tracking_uri = registry_utils._registry_uri = fluent._active_experiment_id = None
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def examples_home(tmp_path_factory):
    """A launch home holding the shipped examples' prepared inputs (what `make examples` makes in the repository),
    made once per session: with RAYSPEED_HOME set to it, the shipped job files' ./runs/examples/ paths resolve
    there. Returns (home, {"model": ..., "chats": ..., "records": ...})."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_chat_model", ROOT / "scripts" / "make_tiny_chat_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    home = tmp_path_factory.mktemp("examples-home")
    made = mod.save(str(home / "runs" / "examples" / "tiny-chat"))
    from _hf_models import tiny

    made["tiny-llama"] = str(home / "runs" / "examples" / "tiny-llama")
    tiny.save(made["tiny-llama"], tokenizer=True)  # what `make examples` runs: the script's defaults
    spec = importlib.util.spec_from_file_location("make_tiny_sum_model", ROOT / "scripts" / "make_tiny_sum_model.py")
    sums = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sums)
    made["tiny-sum"] = sums.save(str(home / "runs" / "examples" / "tiny-sum"), steps=0)  # its files, untrained
    spec = importlib.util.spec_from_file_location("make_tiny_vision_model",
                                                  ROOT / "scripts" / "make_tiny_vision_model.py")
    vision = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vision)
    made["tiny-vision"] = vision.save(str(home / "runs" / "examples" / "tiny-vision"))
    return home, made


# ---------------------------------------------------------------- the time budget (tests/_budget.py)

import _budget  # noqa: E402

_BUDGET = _budget.Budget()


# Under pytest-xdist the controller hears every worker's reports: a worker counts nothing itself.
_XDIST_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))


def pytest_runtest_logreport(report):
    if not _XDIST_WORKER:
        _BUDGET.add(report.nodeid, report.duration)


def pytest_sessionfinish(session, exitstatus):
    # Runs before the terminal summary, which then prints the table.
    _BUDGET.write_spent()
    if _budget.enabled() and _BUDGET.spent:
        _BUDGET.over = _BUDGET.problems()
        if exitstatus == 0 and _BUDGET.over:
            session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _BUDGET.over is None:
        return
    terminalreporter.write_line(f"time budget: {sum(_BUDGET.spent.values()):.0f} s in {len(_BUDGET.spent)} modules "
                                f"({_BUDGET.total():.0f} s in the run so far); "
                                + ("over budget:" if _BUDGET.over else "every module within its budget"))
    for p in _BUDGET.over:
        terminalreporter.write_line(f"  {p}")
