"""The one place an MLflow client is made: tracking and registry on the same store (a registered model lives
where its run does). mlflow is imported here, lazily, so planning and config checks never pay for it.

An MLflow server with authentication (`mlflow server --app-name basic-auth`, what configs/cluster/ starts) is
reached with the credentials the MLflow client reads from the environment itself: MLFLOW_TRACKING_USERNAME and
MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN for a bearer token). `tracking_env` is what the launcher hands
to the Ray workers (rank 0 logs from any node); `access_problem` is the launcher's check before anything is
written: a server that answers 401/403 is a config error (exit 2), one that does not answer is not (training
continues without tracking, as always).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from typing import Any, Iterator, Optional

from rayspeed.redact import redact_text, redact_uri

# Read by the MLflow client itself; forwarded to the workers, never logged.
TRACKING_CREDENTIAL_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                           "MLFLOW_TRACKING_INSECURE_TLS")


# mlflow's package imports itself in an order that two threads importing it at once can break ("cannot import name
# ... from partially initialized module"): rank 0 makes its first client on the logger's thread while others start.
_IMPORT_LOCK = threading.RLock()  # re-entrant: a signal handler on the same thread may make a client too


def mlflow_client(uri: Optional[str]) -> Any:
    with _IMPORT_LOCK:
        from mlflow.tracking import MlflowClient

        from rayspeed.tracking.sqlite_store import prepare

        prepare(uri)
        return MlflowClient(tracking_uri=uri, registry_uri=uri)


def set_terminated(client: Any, run_id: str, status: str) -> None:
    """client.set_terminated, with the run's link MLflow prints to stdout redacted (it is built from the tracking
    URI, credentials and all)."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            client.set_terminated(run_id, status=status)
    finally:
        if buf.getvalue():
            sys.stdout.write(redact_text(buf.getvalue()))


def tracking_env(environ: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The MLflow credential variables of this environment (for the Ray workers' runtime environment)."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in TRACKING_CREDENTIAL_ENV if env.get(k)}


@contextlib.contextmanager
def one_try(timeout_s: float) -> Iterator[None]:
    """MLflow's HTTP retries off for one probe (its default retries an unreachable server for minutes)."""
    keys = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(int(timeout_s))}
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def http_status(e: BaseException) -> Optional[int]:
    """The HTTP status of an MLflow REST error (None for anything else)."""
    get = getattr(e, "get_http_status_code", None)
    try:
        code = int(get()) if get is not None else None
    except Exception:
        return None
    codes = {"UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403}
    return codes.get(getattr(e, "error_code", ""), code)


# How long the launcher waits for a tracking server before it trains without one (MLflow's own retries of an
# unreachable server last about 4 minutes).
PROBE_TIMEOUT_S = 5.0


# A launch asks several times (access, train.init_from, the run): one answer per server for a few seconds.
_ANSWERS: dict[tuple[str, ...], tuple[float, Optional[str], Optional[BaseException]]] = {}
PROBE_REUSE_S = 10.0


def _ask(uri: str, timeout_s: float) -> tuple[Optional[str], Optional[BaseException]]:
    """(why the server does not answer or None, the error it answered with or None), from one request of at
    most timeout_s, reused for PROBE_REUSE_S."""
    import time

    key = (uri, *(os.environ.get(k, "") for k in TRACKING_CREDENTIAL_ENV))  # other credentials, another answer
    seen = _ANSWERS.get(key)
    if seen and time.monotonic() - seen[0] < PROBE_REUSE_S:
        return seen[1], seen[2]
    why: Optional[str] = None
    error: Optional[BaseException] = None
    try:
        with one_try(timeout_s):
            mlflow_client(uri).search_experiments(max_results=1)
    except Exception as e:
        text = str(e)
        if "failed with exception" not in text and getattr(e, "error_code", "") != "INTERNAL_ERROR":
            error = e  # an HTTP error status: the server is there
        else:
            why = next((c.lower() for c in ("Connection refused", "timed out", "Name or service not known",
                                            "No route to host", "Temporary failure in name resolution",
                                            "Connection reset") if c.lower() in text.lower()),
                       redact_text(text.splitlines()[0][:200]) if text else type(e).__name__)
    _ANSWERS[key] = (time.monotonic(), why, error)
    return why, error


def unreachable(uri: str, timeout_s: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """None when the tracking store at `uri` answers (any HTTP answer: a 401 is an answer); else why it does not,
    in one line, after one try of at most timeout_s (an answer is reused for PROBE_REUSE_S). Stores that are not
    servers always answer."""
    if not uri.lower().startswith(("http://", "https://")):
        return None
    return _ask(uri, timeout_s)[0]


def access_problem(uri: str, key: str = "tracking.uri", timeout_s: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """One line when the MLflow server at `uri` refuses this process (401: no or wrong credentials; 403: no
    permission), else None (also when it does not answer: tracking never stops training). Only http(s) URIs are
    probed; a local store has no authentication."""
    if not uri.lower().startswith(("http://", "https://")):
        return None
    down, error = _ask(uri, timeout_s)
    if down or error is None:
        return None  # it answered, or it does not answer: nobody is refused (tracking waits for it: bad luck)
    status = http_status(error)
    where = f"{key}: the MLflow server at {redact_uri(uri)}"
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    if status == 401:
        given = (f"the credentials of MLFLOW_TRACKING_USERNAME={user} were refused" if user
                 else "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD are not set")
        return (f"{where} requires authentication and {given} (401): export MLFLOW_TRACKING_USERNAME and "
                "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) with an account of that server; the launcher "
                "hands them to the workers and never logs them")
    if status == 403:
        return (f"{where} refused user {user or '(none)'} (403 permission denied): ask its admin for access to the "
                "experiment and the registered model, or use another account (MLFLOW_TRACKING_USERNAME/PASSWORD)")
    return None
