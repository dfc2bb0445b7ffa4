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
from typing import Any, Optional

from rayspeed import compat, paths
from rayspeed.cluster import connect_ray
from rayspeed.config.load import load, to_dict, to_yaml
from rayspeed.config.schema import JobConfig
from rayspeed.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, ConfigError
from rayspeed.paths import auto_home_problem, is_uri, storage_path, tracking_uri
from rayspeed.redact import redact_text, redact_uri
from rayspeed.storage import forwarded_env, locate
from rayspeed.train.interrupt import EXIT_INTERRUPTED, Interruption
from rayspeed.train.payload import LaunchPayload, RunResult

log = logging.getLogger("rayspeed")


def train_command(args: argparse.Namespace) -> int:
    """`python jobs/train.py` / `rayspeed train`: check, plan, then run under Ray Train or in this process."""
    from rayspeed.logs import VERBOSE_ENV, plain_unless_terminal, quiet_benign, setup
    from rayspeed.train.timeline import Timeline

    clock = Timeline.since_process_start()
    clock.mark("interpreter")
    setup()
    plain_unless_terminal()
    if getattr(args, "verbose", False):
        os.environ[VERBOSE_ENV] = "1"  # the workers inherit it (worker_env)
    try:
        job = load(args.config, args.overrides)
        clock.mark("config")
        quiet_benign(job.cluster.use_gpu)
        world = 1 if args.launcher == "local" else job.cluster.max_workers
        from rayspeed.planner import resolve

        cfg, plan = resolve(job, world_size=world)
        clock.mark("plan")
        lr = plan.rules.get("lr", {})
        if lr.get("applied") and "warning" in lr:
            log.warning("%s", lr["warning"])
        if job.train.warmup_steps > job.train.max_steps:
            log.warning("train.warmup_steps (%d) is longer than train.max_steps (%d): the learning rate never reaches "
                        "train.lr", job.train.warmup_steps, job.train.max_steps)
        from rayspeed.train.launch_checks import launch_problems

        # The tracking server's answer, storage, train.init_from and the data inputs: the dry run checks exactly
        # what the launch checks, before anything is written, and reports every problem at once.
        problems = launch_problems(job, cfg, args.launcher)
        if problems:
            raise ConfigError(problems)
        clock.mark("checks")
        if args.dry_run:
            from rayspeed.tracking.client import unreachable

            down = unreachable(tracking_uri(cfg))
            if down:  # not a problem (tracking waits for the server), but the dry run checked it: say what it found
                log.warning("tracking: the MLflow server at %s does not answer (%s); a launch would train anyway and "
                            "create the job's run once it answers", redact_uri(tracking_uri(cfg)), down)
            print(to_yaml(cfg))
            print(plan.explain)
            return EXIT_OK
        from rayspeed.train import resume_guard

        resume_guard.check(job, str(locate(storage_path(cfg)).child(cfg.name)), args.resume)
        ray_info = connect_ray(cfg) if args.launcher == "ray" else None
        clock.mark("ray")
        unsafe = auto_home_problem(cfg, nodes=ray_info["nodes"] if ray_info else 1)
        if unsafe:
            raise ConfigError(unsafe)
        from rayspeed.train.data_setup import prepare

        # Tokenized once here (Ray Data on the cluster, or a local process pool), before the MLflow run exists: a
        # bad record is exit 2 with nothing written. The workers then open the committed token shards.
        prepare(cfg, storage_path(cfg), args.launcher)
        clock.mark("data")
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        log.warning("interrupted before training started: no MLflow run and no checkpoint were written")
        return EXIT_INTERRUPTED
    return _run(job, cfg, args.launcher, ray_info, args.resume, clock)


# ---------------------------------------------------------------- Ray


def worker_env(cfg: JobConfig, storage: str, embedded: bool) -> dict[str, str]:
    """What every Ray worker's environment gets, before its process group exists: the communication profile for
    this cluster size plus cluster.env (logged as one line, secret values masked), the object store's credentials
    when storage is a URI (also set on the job by connect_ray; said again for a driver joined from elsewhere), and
    the MLflow credentials (rank 0 logs from whichever node it lands on). The values themselves are unmasked."""
    from rayspeed.health.envprofile import log_profile
    from rayspeed.tracking.client import tracking_env

    env = dict(log_profile(cfg, cfg.cluster.max_workers) or {})
    from rayspeed.logs import VERBOSE_ENV

    if os.environ.get(VERBOSE_ENV):
        env[VERBOSE_ENV] = os.environ[VERBOSE_ENV]
    if is_uri(storage):
        env = {**forwarded_env(remote=not embedded), **env}
    return {**tracking_env(), **env}


def _ray_train(cfg: JobConfig, payload: LaunchPayload, embedded: bool, stop: Any) -> Optional[dict]:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    from rayspeed.compat.ray_backend import ProcessGroupConfig
    from rayspeed.train.resilience import ResilienceCallback
    from rayspeed.train.worker import train_loop

    c, r = cfg.cluster, cfg.resilience
    least = c.effective_min_workers(r.stability_threshold)
    workers = (least, c.max_workers) if c.elastic and least < c.max_workers else c.max_workers
    capacity = ""
    if c.elastic:
        log.info("elastic: %d to %d workers; a (re)start needs at least %d (resilience.stability_threshold %g of %d), "
                 "and waits for them up to %.0f s", c.min_workers, c.max_workers, least, r.stability_threshold,
                 c.max_workers, r.capacity_wait_s)
        capacity = (f"fewer than {least} workers could start for {r.capacity_wait_s:.0f} s: the job needs at least "
                    f"resilience.stability_threshold ({r.stability_threshold:g}) x {c.max_workers} workers; add "
                    "capacity, lower resilience.stability_threshold, or raise resilience.capacity_wait_s")
    env = worker_env(cfg, payload.storage_path, embedded)
    compat.set_worker_group_start_timeout(cfg.resilience.worker_start_timeout_s)
    trainer = compat.lean_trainer_class(embedded, stop.abort_with)(
        train_loop_per_worker=train_loop,
        train_loop_config=payload,
        # Ray Train v2's configs at run time; mypy reads ray.train's v1 (ray.air) stubs, without these fields.
        scaling_config=ScalingConfig(  # type: ignore[call-arg]
            num_workers=workers,  # type: ignore[arg-type]
            use_gpu=c.use_gpu,
            resources_per_worker={"CPU": c.cpus_per_worker, **c.resources_per_worker},
            placement_strategy=c.placement_strategy,
            elastic_resize_monitor_interval_s=cfg.resilience.elastic_monitor_interval_s,
        ),
        torch_config=ProcessGroupConfig(backend="nccl" if c.use_gpu else "gloo",
                                        timeout_s=int(cfg.resilience.collective_timeout_s)),
        run_config=RunConfig(  # type: ignore[call-arg]
            name=cfg.name,
            storage_path=payload.storage_path,
            # An out-of-memory re-plan is a restart too, counted here with the others (not yet apart: a wider
            # budget would let max_failures: 0 restart): the attempt that ends the job after the last re-plan
            # needs oom_replans + 1 of them (rayspeed.train.oom).
            failure_config=FailureConfig(max_failures=r.max_failures),
            # Retention is the manifest protocol's job (rayspeed.checkpoint.manifest.prune).
            checkpoint_config=CheckpointConfig(num_to_keep=None),
            callbacks=[ResilienceCallback(payload.experiment_dir, r.capacity_wait_s, capacity)],
            worker_runtime_env={"env_vars": env} if env else {},
        ),
    )
    return trainer.fit().return_value


# ---------------------------------------------------------------- run


def _run(job: JobConfig, cfg: JobConfig, launcher: str, ray_info: dict[str, Any] | None, resume: str,
         clock: Any) -> int:
    from rayspeed.tracking.client import unreachable
    from rayspeed.tracking.runs import finish_run, supersede_run
    from rayspeed.train import resilience, resume_guard

    storage = storage_path(cfg)
    exp = locate(storage).child(cfg.name)
    # Tracking never stops training, nor delays it: a server that does not answer within a few seconds is not
    # waited for (MLflow's own retries would hold the launch for minutes).
    down = unreachable(tracking_uri(cfg))
    if resume == "fresh" and exp.exists():
        log.warning("--fresh: %s", resume_guard.set_aside(exp))
        if not down:  # else rank 0 sets the old run aside once the server answers (LaunchPayload.resume)
            supersede_run(cfg)
    exp.mkdirs()
    for stale in (paths.DEFERRED_RUN,):  # an earlier submission's: this one's rank 0 writes its own
        if exp.exists(stale):
            exp.delete(stale)
    if compat.forget_reported_checkpoints(exp):
        log.info("set aside Ray Train's list of checkpoints from an earlier rayspeed: the checkpoints' manifests "
                 "choose where this submission resumes")
    # A new submission: an earlier incident (say, a job that ran out of restarts) is not recovered by this start.
    resilience.close_incidents(str(exp), "a new submission")
    run_id = _open_run(cfg, str(exp), down)
    identity = resume_guard.run_identity(job)
    clock.mark("mlflow")
    payload = LaunchPayload(job=to_dict(job), tracking_uri=tracking_uri(cfg), storage_path=storage,
                            experiment_dir=str(exp), launched_at=clock.started, mlflow_run_id=run_id, resume=resume,
                            tracking_deferred=bool(down), run_identity=identity, start_phases=dict(clock.phases),
                            handed_at=time.time())
    error: Exception | None = None
    stop = Interruption(lambda sig: _record_interruption(cfg, exp, launcher, run_id, bool(down), sig))
    try:
        # One result under both launchers: rank 0's RunResult, returned (through Ray Train's Result under Ray).
        with stop:
            if launcher == "local":
                returned = _run_local(cfg, payload)
            else:
                returned = _ray_train(cfg, payload, embedded=bool(ray_info and ray_info.get("started")), stop=stop)
        result = RunResult.from_json(returned)
    except KeyboardInterrupt:
        if stop.signal is None:  # raised before the handlers were in place
            stop.signal = "SIGINT"
            _record_interruption(cfg, exp, launcher, run_id, bool(down), stop.signal)
        result = RunResult(status="interrupted")
    except Exception as e:
        error, result = e, RunResult(status="failed")
    if run_id is None and down:  # a deferred run, created by rank 0 once the server answered (also on failure)
        run_id = result.mlflow_run_id or exp.read_json(paths.DEFERRED_RUN).get("run_id")
    if stop.signal and result.status != "finished":
        return _settle_interruption(cfg, exp, launcher, run_id, down, stop.signal)
    if result.status != "finished" and error is None:
        error = RuntimeError(f"{result.status}: {result.error or ''}")
    status = "finished" if error is None else (result.status if result.status not in ("unknown",) else "failed")
    summary = result.summary(cfg.name, launcher, status=status, mlflow_run_id=run_id)
    if error is not None:
        summary["error"] = redact_text(f"{type(error).__name__}: {str(error)[:2000]}")
    exp.write_json(paths.SUMMARY, summary)
    if run_id:
        finish_run(cfg, run_id, "FINISHED" if error is None else "FAILED", summary["status"])
    print(json.dumps(summary), flush=True)
    if error is not None:
        log.error("training failed: %s", summary["error"].splitlines()[0])
        return EXIT_FAILED
    return EXIT_OK


def _open_run(cfg: JobConfig, experiment_dir: str, down: Optional[str]) -> Optional[str]:
    """The job's MLflow run, found or created (None: the server is down, rank 0 makes it later; or tracking is
    unavailable), with what an earlier launch could not send delivered to it (rayspeed.tracking.spool)."""
    from rayspeed.tracking.client import PROBE_TIMEOUT_S
    from rayspeed.tracking.runs import find_or_create_run
    from rayspeed.tracking.spool import deliver_spool, spooled

    if down:
        log.warning("MLflow: the tracking server at %s does not answer (%s, after one try of at most %.0f s): "
                    "training starts now; rank 0 creates or finds the job's run when the server answers, and "
                    "logs what it queued meanwhile", redact_uri(tracking_uri(cfg)), down, PROBE_TIMEOUT_S)
        return None
    try:
        run_id, resumed = find_or_create_run(cfg)
        log.info("MLflow run %s (%s) at %s", run_id, "continued" if resumed else "new", redact_uri(tracking_uri(cfg)))
    except Exception as e:  # tracking must never stop training
        log.warning("MLflow unavailable (%s): training without tracking", redact_text(str(e).splitlines()[0]))
        return None
    if spooled(experiment_dir):
        deliver_spool(experiment_dir, tracking_uri(cfg), run_id)
    return run_id


def _settle_interruption(cfg: JobConfig, exp: Any, launcher: str, run_id: Optional[str], deferred: Optional[str],
                         signal_name: str) -> int:
    """After the workers stopped: a save that was in flight when the signal came may have committed after the line
    was printed. Then the record is written again (summary.json's resume_from, one more line), so the last word names
    the checkpoint the same command resumes."""
    from rayspeed.checkpoint import manifest

    newest, _ = manifest.latest_verified(str(exp), deep=False)
    if newest and exp.read_json(paths.SUMMARY).get("resume_from") != manifest.name_of(newest):
        log.warning("a save in flight at the signal has committed since")
        _record_interruption(cfg, exp, launcher, run_id, bool(deferred), signal_name)
    return EXIT_INTERRUPTED


def _record_interruption(cfg: JobConfig, exp: Any, launcher: str, run_id: Optional[str], deferred: bool,
                         signal_name: str) -> None:
    """The run is being stopped by a signal: summary.json, the MLflow run KILLED, one line saying where it stands and
    how to go on. Called from the signal handler, before the workers stop (rayspeed.train.interrupt)."""
    from rayspeed.checkpoint import manifest
    from rayspeed.tracking.runs import finish_run
    from rayspeed.train import resilience

    newest, _ = manifest.latest_verified(str(exp), deep=False)
    saved = manifest.step_of(newest) if newest else None
    # Rank 0 publishes its step about once a second: never less than the checkpoint it has committed.
    step = max(int(resilience.read_progress(str(exp)).get("step") or 0), int(saved or 0))
    if run_id is None and deferred:
        run_id = exp.read_json(paths.DEFERRED_RUN).get("run_id")
    summary = RunResult(status="interrupted", steps=step).summary(
        cfg.name, launcher, mlflow_run_id=run_id, signal=signal_name,
        resume_from=manifest.name_of(newest) if newest else None)
    exp.write_json(paths.SUMMARY, summary)
    if run_id:
        finish_run(cfg, run_id, "KILLED", "interrupted")
    print(json.dumps(summary), flush=True)
    where = f"newest verified checkpoint {manifest.name_of(newest)}" if newest else "no verified checkpoint yet"
    log.warning("interrupted (%s) after step %d; %s; run the same command to resume%s", signal_name, step, where,
                "" if newest else " (it starts again from step 0)")


def _run_local(cfg: JobConfig, payload: LaunchPayload) -> Optional[dict]:
    from rayspeed.health.envprofile import log_profile
    from rayspeed.train.context import local_context
    from rayspeed.train.worker import run_worker

    for k, v in log_profile(cfg, 1).items():
        os.environ.setdefault(k, v)
    backend = "nccl" if cfg.cluster.use_gpu else "gloo"
    ctx = local_context(payload.experiment_dir, backend, cfg.resilience.collective_timeout_s)
    return run_worker(payload, ctx).to_json()

