"""`python jobs/train.py`: check the job, plan it, then run it under Ray Train or in-process.

Everything that can be wrong with the input is found before anything is written: exit 2 with one message,
no traceback, nothing in MLflow or storage. Exit 1 means training failed after the allowed restarts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from rayspeed.config.load import load, to_dict, to_yaml
from rayspeed.config.schema import AUTO, JobConfig
from rayspeed.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, ConfigError

log = logging.getLogger("rayspeed")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="jobs/train.py", description="Train a rayspeed job.")
    ap.add_argument("--config", required=True, help="job YAML file")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key (value parsed as YAML)")
    ap.add_argument("--launcher", choices=("ray", "local"), default="ray", help="ray (default): Ray Train; local: this process, world size 1")
    ap.add_argument("--dry-run", action="store_true", help="print the resolved config and plan, train nothing")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from rayspeed.logs import setup

    setup()
    args = parse_args(argv)
    try:
        job = load(args.config, args.set)
        world = 1 if args.launcher == "local" else job.cluster.max_workers
        from rayspeed.planner import resolve

        cfg, plan = resolve(job, world_size=world)
        from rayspeed.health.checks import problems as health_problems

        bad = health_problems(cfg)  # health keys and the linted cluster.env
        if bad:
            raise ConfigError(bad)
        if args.dry_run:
            print(to_yaml(cfg))
            print(plan.explain)
            return EXIT_OK
        from rayspeed.storage import check_reachable
        from rayspeed.paths import storage_path

        unreachable = check_reachable(storage_path(cfg))  # before anything is written anywhere
        if unreachable:
            raise ConfigError(unreachable)
        ray_info = _connect_ray(cfg) if args.launcher == "ray" else None
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_BAD_INPUT
    return _run(job, cfg, plan, args.launcher, ray_info)


# ---------------------------------------------------------------- Ray


def _local_cpus(cfg: JobConfig) -> int:
    c = cfg.cluster
    if c.local_num_cpus != AUTO:
        return int(c.local_num_cpus)
    # Logical CPUs, not cores: 4 CPU workers may share 2 cores (they then run slower, but they run).
    need = int(c.max_workers * c.cpus_per_worker + 0.999) + 1
    return max(os.cpu_count() or 1, need)


# The cluster this driver starts for itself lives and dies with the job, on one machine: what a shared
# cluster needs is overhead here. Measured on the 2-core CPU demo, every idle Ray actor's core worker costs
# ~0.009 cores (its main thread wakes every 10 ms) and the dashboard with its module processes ~0.035, all
# taken from the training processes (docs/BENCHMARKS.md). So: no dashboard (nothing to browse on a random
# port; the job's record is MLflow), no preemption watcher (a local machine is not a spot instance), no
# Prometheus metrics from Ray Train (the job's metrics go to MLflow); and in `_embedded_trainer` no
# placement-group cleaner (the placement group dies with the cluster) and no dataset manager (no Ray Data).
EMBEDDED_RAY_ENV = {
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_enable_metrics_collection": "0",
    # The worker Ray prestarts for the driver sat idle through the run (the controller got its own).
    "RAY_prestart_worker_first_driver": "0",
}
_EMBEDDED_SKIP = ("PlacementGroupCleanerCallback",)


def _trainer_class(embedded: bool):
    """TorchTrainer, without the callbacks that do nothing for this job (each one an idle actor).

    DatasetsCallback is skipped on every cluster when no Ray Dataset is passed (rayspeed reads its own token
    memmaps): it would start a DatasetManager actor per attempt. The controller builds its callbacks in
    `_create_default_callbacks` (Ray 2.60); if that method goes away the plain trainer is used.
    """
    from ray.train.torch import TorchTrainer

    if not hasattr(TorchTrainer, "_create_default_callbacks"):
        return TorchTrainer
    skip = {"DatasetsCallback", *(_EMBEDDED_SKIP if embedded else ())}

    class RayspeedTrainer(TorchTrainer):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            if self.datasets:
                return callbacks
            return [cb for cb in callbacks if type(cb).__name__ not in skip]

    return RayspeedTrainer


def _connect_ray(cfg: JobConfig) -> dict[str, Any]:
    address = cfg.cluster.address if cfg.cluster.address != AUTO else os.environ.get("RAY_ADDRESS")
    # Ray reads RAY_AUTH_MODE when it is imported, so it is decided before the import. Token auth is on for
    # the embedded cluster (said explicitly, so Ray does not warn about its default); a driver joining a
    # cluster presents the token when one exists (clusters started by `make up` refuse drivers without it).
    if "RAY_AUTH_MODE" not in os.environ and (not address or (Path.home() / ".ray" / "auth_token").exists()):
        os.environ["RAY_AUTH_MODE"] = "token"
    import ray

    from rayspeed.storage import forwarded_env
    from rayspeed.paths import is_uri
    from rayspeed.paths import storage_path

    # The Ray Train controller and workers open the object store too, in processes this driver did not start:
    # the credentials/endpoint this driver reached the bucket with go with the job.
    job_env = forwarded_env(remote=bool(address)) if is_uri(storage_path(cfg)) else {}
    runtime_env = {"env_vars": job_env} if job_env else None
    if ray.is_initialized():  # embedded in a process that already joined a cluster (tests, notebooks)
        address, started = "existing", False
    elif address:
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True, runtime_env=runtime_env)
        except ConnectionError as e:
            key = "cluster.address" if cfg.cluster.address != AUTO else "RAY_ADDRESS"
            raise ConfigError(
                f"{key}: no Ray cluster answers at {address} ({str(e).splitlines()[0]}); start one with "
                "`make up`, fix the address, or unset it to train on a local Ray started for this job"
            ) from None
        started = False
    else:
        # "local" starts a fresh cluster explicitly: a stale /tmp/ray/ray_current_cluster must not be joined.
        for k, v in EMBEDDED_RAY_ENV.items():
            os.environ.setdefault(k, v)
        ray.init(address="local", num_cpus=_local_cpus(cfg), include_dashboard=False, logging_level=logging.WARNING,
                 runtime_env=runtime_env)
        started = True
    total = ray.cluster_resources()
    c = cfg.cluster
    per_worker = {"CPU": c.cpus_per_worker, **c.resources_per_worker}
    if c.use_gpu:
        per_worker["GPU"] = 1.0
    problems = []
    for res, amount in per_worker.items():
        have = float(total.get(res, 0.0))
        need = amount * c.min_workers
        if need > have + 1e-9:
            problems.append(
                f"cluster.num_workers ({c.num_workers}): {c.min_workers} workers x {amount:g} {res} = {need:g} {res}, "
                f"but the Ray cluster has {have:g} {res} in all; lower cluster.num_workers or "
                f"cluster.{'cpus_per_worker' if res == 'CPU' else 'resources_per_worker'}, or add nodes"
            )
    if problems:
        ray.shutdown()
        raise ConfigError(problems)
    return {"address": address or "local", "started": started, "resources": total}


def _ray_train(cfg: JobConfig, launch: dict[str, Any], storage: str, exp_dir: str, embedded: bool):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from rayspeed.train.resilience import ResilienceCallback
    from rayspeed.train.worker import train_loop

    from rayspeed.health.envprofile import log_profile

    c = cfg.cluster
    workers = (c.min_workers, c.max_workers) if c.elastic else c.max_workers
    # The communication profile for this cluster size (plus cluster.env), in every worker's environment
    # before its process group exists.
    env = log_profile(cfg, c.max_workers)
    from rayspeed.storage import forwarded_env
    from rayspeed.paths import is_uri

    if is_uri(storage):  # also set on the job (_connect_ray); said again for a driver joined from elsewhere
        env = {**forwarded_env(remote=not embedded), **(env or {})}
    # Ray Train waits this long for a worker group to start before calling the attempt failed; after a node
    # loss it first retries the old size, so the default 60 s is pure recovery delay. Read by the controller.
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", str(cfg.resilience.worker_start_timeout_s))
    trainer = _trainer_class(embedded)(
        train_loop_per_worker=train_loop,
        train_loop_config=launch,
        scaling_config=ScalingConfig(
            num_workers=workers,
            use_gpu=c.use_gpu,
            resources_per_worker={"CPU": c.cpus_per_worker, **c.resources_per_worker},
            placement_strategy=c.placement_strategy,
            elastic_resize_monitor_interval_s=cfg.resilience.elastic_monitor_interval_s,
        ),
        torch_config=TorchConfig(backend="nccl" if c.use_gpu else "gloo", timeout_s=int(cfg.resilience.collective_timeout_s)),
        run_config=RunConfig(
            name=cfg.name,
            storage_path=storage,
            failure_config=FailureConfig(max_failures=cfg.resilience.max_failures),
            # Retention is the manifest protocol's job (rayspeed.checkpoint.manifest.prune).
            checkpoint_config=CheckpointConfig(num_to_keep=None),
            callbacks=[ResilienceCallback(exp_dir)],
            worker_runtime_env={"env_vars": env} if env else {},
        ),
    )
    return trainer.fit()


# ---------------------------------------------------------------- run


def _run(job: JobConfig, cfg: JobConfig, plan: Any, launcher: str, ray_info: dict[str, Any] | None) -> int:
    from rayspeed.paths import storage_path, tracking_uri
    from rayspeed.tracking.runs import find_or_create_run, finish_run

    from rayspeed.storage import locate

    storage = storage_path(cfg)
    exp = locate(storage).child(cfg.name)
    exp.mkdirs()
    run_id = None
    try:
        run_id, resumed = find_or_create_run(cfg)
        log.info("MLflow run %s (%s) at %s", run_id, "continued" if resumed else "new", tracking_uri(cfg))
    except Exception as e:  # tracking must never stop training
        log.warning("MLflow unavailable (%s): training without tracking", e)
    launch = {
        "job": to_dict(job),
        "mlflow_run_id": run_id,
        "tracking_uri": tracking_uri(cfg),
        "storage_path": storage,
        "experiment_dir": str(exp),
        "launched_at": time.time(),
    }
    status, error = "FINISHED", None
    try:
        if launcher == "local":
            result = _run_local(cfg, launch, str(exp))
        else:
            _ray_train(cfg, launch, storage, str(exp), embedded=bool(ray_info and ray_info.get("started")))
            result = exp.read_json("worker_result.json")
    except Exception as e:
        status, error = "FAILED", e
        result = {}
    if result.get("status") not in (None, "finished") and error is None:
        status, error = "FAILED", RuntimeError(f"{result['status']}: {result.get('error', '')}")
    summary = {
        "name": cfg.name,
        "status": "finished" if status == "FINISHED" else result.get("status", "failed"),
        "steps": result.get("steps", 0),
        "final_loss": result.get("final_loss"),
        "val_loss": result.get("val_loss"),
        "mlflow_run_id": run_id,
        "restarts": result.get("restarts", 0),
        "world_size": result.get("world_size"),
        "global_batch_size": result.get("global_batch_size"),
        "recovery_s": result.get("recovery_s"),
        "checkpoint_stall_s": result.get("checkpoint_stall_s"),
        "model_state_bytes": result.get("model_state_bytes"),
        "registered_model_version": result.get("registered_model_version"),
        "layout": result.get("layout"),
        "launcher": launcher,
    }
    if error is not None:
        summary["error"] = f"{type(error).__name__}: {str(error)[:2000]}"
    exp.write_json("summary.json", summary)
    if run_id:
        finish_run(cfg, run_id, status, summary["status"])
    if error is not None:
        log.error("training failed: %s", summary["error"].splitlines()[0])
        print(json.dumps(summary), flush=True)
        return EXIT_FAILED
    print(json.dumps(summary), flush=True)
    return EXIT_OK


def _run_local(cfg: JobConfig, launch: dict[str, Any], exp_dir: str) -> dict[str, Any]:
    from rayspeed.train.context import local_context
    from rayspeed.train.worker import run_worker

    from rayspeed.health.envprofile import log_profile

    for k, v in log_profile(cfg, 1).items():
        os.environ.setdefault(k, v)
    backend = "nccl" if cfg.cluster.use_gpu else "gloo"
    ctx = local_context(exp_dir, backend, cfg.resilience.collective_timeout_s)
    return run_worker(launch, ctx)

