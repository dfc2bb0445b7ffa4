"""Joining a Ray cluster, or starting the one a job runs on by itself: what the launcher, the healthcheck and the
calibration share."""

from __future__ import annotations

import logging
import os
from typing import Any

from rayspeed.config.schema import AUTO, JobConfig
from rayspeed.config.validate import capacity_problems
from rayspeed.errors import ConfigError


def local_cpus(cfg: JobConfig) -> int:
    c = cfg.cluster
    if c.local_num_cpus != AUTO:
        return int(c.local_num_cpus)
    # Logical CPUs, not cores: 4 CPU workers may share 2 cores (they then run slower, but they run).
    need = int(c.max_workers * c.cpus_per_worker + 0.999) + 1
    return max(os.cpu_count() or 1, need)


# Every job, on any cluster: no preemption watcher. Ray Train's watcher is an actor (a process: 1.5 s of CPU at
# every start on the 2-core demo, docs/BENCHMARKS.md "What a start costs") that stores a node's drain notice for
# the train function to read; rayspeed's loop does not read it (a preempted node is a lost node: resume from the
# newest verified checkpoint). Ray Train passes the variable from this driver to its controller.
JOB_RAY_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}

# The cluster this driver starts for itself lives and dies with the job, on one machine: what a shared
# cluster needs is overhead here. Measured on the 2-core CPU demo, every idle Ray actor's core worker costs
# ~0.009 cores (its main thread wakes every 10 ms) and the dashboard with its module processes ~0.035, all
# taken from the training processes (docs/BENCHMARKS.md). So: no dashboard (nothing to browse on a random
# port; the job's record is MLflow), no Prometheus metrics from Ray Train (the job's metrics go to MLflow); and
# (rayspeed.compat.lean_trainer_class) no dataset manager (no Ray Data).
EMBEDDED_RAY_ENV = {
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_enable_metrics_collection": "0",
    # The worker Ray prestarts for the driver sat idle through the run (the controller got its own).
    "RAY_prestart_worker_first_driver": "0",
}


def connect_ray(cfg: JobConfig) -> dict[str, Any]:
    """Join the cluster the job names (cluster.address, else RAY_ADDRESS) or start a local one for it; checks that
    the cluster can ever hold cluster.num_workers. Returns {"address", "started", "resources"}."""
    address = cfg.cluster.address if cfg.cluster.address != AUTO else os.environ.get("RAY_ADDRESS")
    # Ray reads RAY_AUTH_MODE when it is imported, so it is decided before the import. Token auth is on for the
    # embedded cluster (said explicitly, so Ray does not warn about its default). For an explicit address the
    # mode is never guessed (a token file in ~/.ray says nothing about that cluster): Ray's own default, or what
    # the user exported; a refusal is reported as one line below.
    if "RAY_AUTH_MODE" not in os.environ and not address:
        os.environ["RAY_AUTH_MODE"] = "token"
    import ray
    from ray.exceptions import AuthenticationError

    from rayspeed.paths import is_uri, storage_path
    from rayspeed.storage import forwarded_env

    # The Ray Train controller and workers open the object store too, in processes this driver did not start:
    # the credentials/endpoint this driver reached the bucket with go with the job.
    job_env = forwarded_env(remote=bool(address)) if is_uri(storage_path(cfg)) else {}
    runtime_env = {"env_vars": job_env} if job_env else None
    for k, v in JOB_RAY_ENV.items():  # an operator's own setting wins
        os.environ.setdefault(k, v)
    if ray.is_initialized():  # embedded in a process that already joined a cluster (tests, notebooks)
        address, started = "existing", False
    elif address:
        key = "cluster.address" if cfg.cluster.address != AUTO else "RAY_ADDRESS"
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True, runtime_env=runtime_env)
        except AuthenticationError:
            raise ConfigError(
                f"{key}: the Ray cluster at {address} uses token authentication and this driver has no token "
                "(RAY_AUTH_MODE=token is set): put the cluster's token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or "
                "RAY_AUTH_TOKEN (`ray get-auth-token` on the head prints it)") from None
        except ConnectionError as e:
            if answers(address):
                raise ConfigError(
                    f"{key}: the Ray cluster at {address} answers but refused this driver: it most likely uses token "
                    "authentication; export RAY_AUTH_MODE=token with the cluster's token (~/.ray/auth_token, "
                    "RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN), as `make submit` does") from None
            raise ConfigError(
                f"{key}: no Ray cluster answers at {address} ({str(e).splitlines()[0]}); start one with "
                "`make up`, fix the address, or unset it to train on a local Ray started for this job"
            ) from None
        started = False
    else:
        # "local" starts a fresh cluster explicitly: a stale /tmp/ray/ray_current_cluster must not be joined.
        for k, v in EMBEDDED_RAY_ENV.items():
            os.environ.setdefault(k, v)
        ray.init(address="local", num_cpus=local_cpus(cfg), include_dashboard=False, logging_level=logging.WARNING,
                 runtime_env=runtime_env)
        started = True
    total = ray.cluster_resources()
    problems = capacity_problems(cfg, total)
    if problems:
        ray.shutdown()
        raise ConfigError(problems)
    nodes = sum(1 for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0)
    return {"address": address or "local", "started": started, "resources": total, "nodes": nodes}


def answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something listens at a host:port Ray address (a GCS that refuses us, rather than none at all)."""
    import socket

    hostport = address.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return False
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False
