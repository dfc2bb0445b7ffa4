"""Wait until the local Ray dashboard (any HTTP answer, 401 included: token auth is on) and the MLflow
server (/health) answer, or fail after --timeout seconds with the log to look at."""

import argparse
import sys
import time
import urllib.error
import urllib.request


def _token() -> str | None:
    from pathlib import Path

    p = Path.home() / ".ray" / "auth_token"
    return p.read_text().strip() if p.exists() else None


def answers(url: str) -> bool:
    req = urllib.request.Request(url)
    if url.endswith("/api/jobs/"):
        tok = _token()
        if tok:
            req.add_header("Authorization", f"Bearer {tok}")
    try:
        urllib.request.urlopen(req, timeout=5)
        return True
    except urllib.error.HTTPError:
        # /api/jobs/ must really work (200); elsewhere any answer (e.g. 401 without a token) means "up".
        return not url.endswith("/api/jobs/")
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ray")
    ap.add_argument("--mlflow")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--free-port", action="store_true", help="print a free TCP port on 127.0.0.1 and exit")
    ap.add_argument("--ray-token", action="store_true", help="also wait until the Jobs API accepts the token")
    a = ap.parse_args()
    if a.free_port:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            print(s.getsockname()[1])
        return 0
    pending = {}
    if a.ray:
        pending["ray (see .services/ray.log)"] = a.ray + "/api/version"
        # The job agent comes up after the dashboard: a submit before it answers "No available agent".
        pending["ray job agent (see /tmp/ray/session_latest/logs/dashboard_agent.log)"] = a.ray + "/api/jobs/"
    if a.mlflow:
        pending["mlflow (see .services/mlflow.log)"] = a.mlflow + "/health"
    deadline = time.time() + a.timeout
    while pending and time.time() < deadline:
        for name, url in list(pending.items()):
            if answers(url):
                del pending[name]
        if pending:
            time.sleep(1)
    if pending:
        print("not up after %.0f s: %s" % (a.timeout, ", ".join(pending)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
