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


@pytest.fixture(scope="session")
def ray_head():
    """A real local Ray cluster shared by every integration test of the session."""
    from _cluster import RayHead

    head = RayHead(num_cpus=8)
    yield head
    head.stop()


@pytest.fixture(scope="session")
def s3():
    """A real S3 API (moto's server) for the session, its endpoint and dummy credentials in os.environ while it
    runs. Skips (with the reason) only when moto is not installed or its server cannot start."""
    try:
        import boto3  # noqa: F401
        import moto  # noqa: F401
    except ImportError as e:
        pytest.skip(f"moto[server] is not installed ({e}); pip install -e '.[test]'")
    from _moto import MotoS3

    try:
        server = MotoS3(f"/tmp/rayspeed-test-moto-{os.getpid()}.log")
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
