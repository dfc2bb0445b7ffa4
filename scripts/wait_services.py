"""Wait until the local Ray dashboard (any HTTP answer, 401 included: token auth is on) and the MLflow
server (/health) answer, or fail after --timeout seconds with the log to look at."""

import argparse
import sys
import time
import urllib.error
import urllib.request


def answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2)
        return True
    except urllib.error.HTTPError:
        return True  # it answered (e.g. 401 without a token)
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ray")
    ap.add_argument("--mlflow")
    ap.add_argument("--timeout", type=float, default=120)
    a = ap.parse_args()
    pending = {}
    if a.ray:
        pending["ray (see .services/ray.log)"] = a.ray + "/api/version"
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
