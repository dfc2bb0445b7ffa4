"""A real MLflow tracking server with authentication for the tests: `mlflow server --app-name basic-auth` (what
configs/cluster/ starts) on a free 127.0.0.1 port, SQLite backend and artifacts in a temporary folder, the admin
account bootstrapped from MLFLOW_AUTH_ADMIN_USERNAME / MLFLOW_AUTH_ADMIN_PASSWORD. Needs `mlflow[auth]`
(Flask-WTF), part of the test extras.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from _cluster import stop_process_group
from _moto import _free_port


class MlflowAuthServer:
    def __init__(self, workdir: Path, timeout_s: float = 180.0):
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.username = "admin"
        self.password = "pw-" + secrets.token_hex(12)
        self.artifacts = self.dir / "artifacts"
        self.db = self.dir / "mlflow.db"
        self.log_path = self.dir / "server.log"
        env = {**os.environ, "MLFLOW_AUTH_ADMIN_USERNAME": self.username, "MLFLOW_AUTH_ADMIN_PASSWORD": self.password,
               "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16)}
        for k in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            env.pop(k, None)
        self.log = open(self.log_path, "w")
        mlflow = str(Path(sys.executable).with_name("mlflow"))
        # cwd: the auth app's user store (basic_auth.db, relative in its default config) lands in self.dir.
        self.proc = subprocess.Popen(
            [mlflow, "server", "--app-name", "basic-auth", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.db}",
             "--artifacts-destination", str(self.artifacts)],
            cwd=self.dir, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}: {self.tail()}")
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=2)
                break
            except (urllib.error.URLError, OSError):
                if time.time() > deadline:
                    self.stop()
                    raise RuntimeError(f"mlflow server: no answer within {timeout_s:.0f} s: {self.tail()}") from None
                time.sleep(0.5)

    def tail(self, n: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    @property
    def credentials(self) -> dict[str, str]:
        return {"MLFLOW_TRACKING_USERNAME": self.username, "MLFLOW_TRACKING_PASSWORD": self.password}

    def stop(self) -> None:
        stop_process_group(self.proc, 20)
        self.log.close()
