"""What a training run tells MLflow and the log: the start (params, tags, config and plan artifacts), the metric
windows (loss, throughput, grad-sync share, MFU, system metrics), the first step (model-state bytes, recovery),
validation, checkpoints and the end. One rank-0 gate, here: every other rank holds a NullLogger, so callers
never check ranks; the collectives inside (the window's loss mean, the system-metric gather) run on every rank.

    reporter = Reporter(cfg, plan, ctx, payload, groups, device, attempt_started)
    with reporter.timed_step(step):         # the comm timer measures sampled log steps, left out of throughput
        loss = train_step(...)
    reporter.step_done(step, loss, state, engine)    # window, progress, first-step report
    if reporter.should_log(step): reporter.log_window(step, lr, grad_norm)
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from rayspeed.config.load import flatten, to_dict, to_yaml
from rayspeed.config.schema import JobConfig
from rayspeed.health.calibration import worst_rank_peak_memory_gib
from rayspeed.logs import log_rank
from rayspeed.parallel.objects import gather_objects
from rayspeed.planner.feedback import plan_metrics
from rayspeed.train import resilience
from rayspeed.train.deferred_run import DeferredRun, record_deferred_run

log = logging.getLogger("rayspeed.worker")


def plain(obj: Any) -> Any:
    """JSON-safe copy: dicts, lists and scalars kept, anything else as its str."""
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def versions() -> dict[str, str]:
    import deepspeed

    v = {"versions.torch": torch.__version__, "versions.deepspeed": deepspeed.__version__}
    try:
        import ray

        v["versions.ray"] = ray.__version__
    except Exception:
        pass
    v["versions.cuda"] = str(torch.version.cuda)
    if torch.cuda.is_available():
        v["versions.nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return v


def mfu_terms(cfg: JobConfig) -> tuple[float, Optional[float]]:
    """(model FLOPs per token: ModelShape.flops_per_token, PaLM's 6 N non-embedding + 12 L h s, the one definition;
    peak FLOP/s of one GPU from the planner's tables); no MFU on CPU."""
    try:
        from rayspeed.config.shape import ModelShape
        from rayspeed.planner.hardware import get as hardware

        flops = ModelShape.from_config(cfg.model).flops_per_token
        if not cfg.cluster.use_gpu:
            return float(flops), None
        return float(flops), float(hardware(cfg.cluster.gpu, cfg.cluster.hardware).peak(cfg.train.precision))
    except Exception as e:
        log.warning("MFU unavailable: %s", e)
        return 0.0, None


class StepWindow:
    """Steps and their wall time since the last log step. Each step's time runs from the end of the step before
    (or of a pause) to its own end. Checkpoint and validation time are not step time (pause_excluded), and neither
    is a step the gradient-sync timer measured: it synchronises the device around every collective, so that step
    is slower than the others and is left out of step time, tokens/s and MFU (add(..., measured=True))."""

    def __init__(self, device: torch.device):
        self.loss = torch.zeros((), device=device)
        self.steps = 0
        self.measured = 0
        self.timed_s = 0.0
        self.mark = time.perf_counter()

    def add(self, loss: torch.Tensor, measured: bool = False) -> None:
        now = time.perf_counter()
        self.loss += loss.detach().float()
        self.steps += 1
        if measured:
            self.measured += 1
        else:
            self.timed_s += now - self.mark
        self.mark = now

    def step_time(self) -> Optional[float]:
        """Mean wall time of the window's unmeasured steps; None when every step of it was measured."""
        timed = self.steps - self.measured
        return self.timed_s / timed if timed > 0 else None

    def restart(self) -> None:
        self.loss.zero_()
        self.steps = self.measured = 0
        self.timed_s = 0.0
        self.mark = time.perf_counter()

    def pause_excluded(self) -> None:
        """Time spent outside steps (evaluation, checkpoint) does not count towards the next step time."""
        self.mark = time.perf_counter()


# The gradient-sync timer measures one step per log window; when every window is a single step
# (tracking.log_every_steps 1), one log step in this many.
COMM_SAMPLE_EVERY = 10


class Reporter:
    def __init__(self, cfg: JobConfig, plan: Any, ctx: Any, payload: Any, groups: Any, device: torch.device,
                 attempt_started: float):
        from rayspeed.monitoring.comm_timer import CommTimer
        from rayspeed.tracking.logger import MlflowLogger, NullLogger

        self.cfg, self.plan, self.ctx, self.payload, self.groups = cfg, plan, ctx, payload, groups
        self.device, self.attempt_started = device, attempt_started
        self.log_every = cfg.tracking.log_every_steps
        self.tracker: Any = NullLogger()
        self.monitors_started = False
        if ctx.is_rank0 and (payload.mlflow_run_id or payload.tracking_deferred):
            try:
                # A server that did not answer at launch: the run is found or created once it does, and what was
                # logged meanwhile waits in the logger's queue.
                deferred = None if payload.mlflow_run_id else DeferredRun(cfg, payload, ctx.experiment_dir)
                self.tracker = MlflowLogger(payload.tracking_uri, payload.mlflow_run_id, run_factory=deferred,
                                            on_run=self._run_found)
            except Exception as e:  # tracking must never kill training
                log.warning("MLflow unavailable (%s): training continues without tracking", e)
        self.comm = CommTimer(enabled=True)
        self.window = StepWindow(device)
        self.measuring = False
        self.sampler: Any = None
        self.charts: Any = None
        self.flops_per_token, self.peak_flops = mfu_terms(cfg)
        self.progress = resilience.ProgressRecorder(ctx.experiment_dir) if ctx.is_rank0 else None
        self.first_step_done = False
        self.recovery_s: Optional[float] = None
        self.restarts = 0
        # Steps already in the run's history (a replay after a restart, or a resubmission): not logged twice.
        self.logged_until = self._logged_until() if ctx.is_rank0 else 0
        self.model_state_bytes: Optional[dict[str, int]] = None
        self.checkpoints = 0
        self.last_loss = float("nan")
        # (last step of the window counted from this attempt's start, steps in it, seconds per step): the planner's
        # feedback compares its prediction with the steady-state windows (rayspeed.planner.feedback).
        self.perf_windows: list[tuple[int, int, float]] = []
        self.start_step = 0
        self.inputs_thread: Any = None

    def _logged_until(self) -> int:
        return int(self.tracker.last_step("train/loss"))

    def _run_found(self, run_id: str) -> None:
        """The deferred run exists (called on the logger's thread): charts and registration can use it now."""
        if self.payload.mlflow_run_id == run_id:
            return
        self.payload.mlflow_run_id = run_id
        record_deferred_run(self.ctx.experiment_dir, run_id)
        if self.monitors_started and self.charts is None:
            from rayspeed.tracking.charts import ChartPublisher

            self.charts = ChartPublisher(self.tracker, self.payload.tracking_uri, run_id)

    # ------------------------------------------------------------------ start
    def start_monitors(self) -> None:
        from rayspeed.monitoring.system import SystemSampler

        if self.cfg.tracking.system_metrics:
            self.sampler = SystemSampler(self.ctx.rank, self.ctx.node_id, interval_s=5.0)
        self.monitors_started = True
        if self.ctx.is_rank0 and self.payload.mlflow_run_id:
            from rayspeed.tracking.charts import ChartPublisher

            self.charts = ChartPublisher(self.tracker, self.payload.tracking_uri, self.payload.mlflow_run_id)

    def log_start(self, state: dict[str, Any], ds_config: dict[str, Any], node_ids: list[Any]) -> None:
        if not self.ctx.is_rank0:
            return
        c, t, world = self.cfg, self.tracker, self.ctx.world_size
        params = flatten(to_dict(c))
        params.update({f"plan.{k}": v for k, v in flatten(plain(self.plan.best)).items()})
        params.update(versions())
        params["cluster.world_size_at_start"] = world
        # Where the checkpoints and the store really are, beside the `auto` the job gave (masked like every
        # param: credentials go, paths stay).
        params["storage.path.resolved"] = self.payload.storage_path
        params["tracking.uri.resolved"] = self.payload.tracking_uri
        try:
            from rayspeed.monitoring.system import lineage_params

            params.update(lineage_params(node_ids, use_gpu=c.cluster.use_gpu))
        except Exception as e:
            log.warning("lineage params unavailable: %s", e)
        t.log_params(params)
        t.set_tags({"rayspeed.job": c.name, "rayspeed.status": "running", "rayspeed.world_size": str(world)})
        t.log_text(to_yaml(c), "config/resolved.yaml")
        t.log_text(json.dumps(ds_config, indent=2, sort_keys=True), "config/deepspeed.json")
        t.log_text(json.dumps(plain(self.plan.to_json()), indent=2, default=str), "plan/plan.json")
        t.log_text(self.plan.explain, "plan/explain.txt")
        t.log_metrics({"resilience/world_size": world,
                       "resilience/restarts": resilience.count_restarts(self.ctx.experiment_dir)}, step=state["step"])
        p = c.parallel
        log.info("plan: dp=%s tp=%s pp=%s zero=%s micro=%s accum=%s ac=%s precision=%s global_batch=%s (world %d)",
                 p.dp, p.tp, p.pp, p.zero_stage, p.micro_batch_size, p.grad_accum, p.activation_checkpointing,
                 c.train.precision, c.train.global_batch_size, world)

    def log_data_inputs(self, items: list[dict[str, Any]]) -> None:
        """The training and validation data as the run's MLflow dataset inputs (rank 0, in the background: tracking
        never holds up training; close() waits for it a little)."""
        client = getattr(self.tracker, "client", None)
        if not self.ctx.is_rank0 or client is None or not items:
            return
        import threading

        from rayspeed.tracking.dataset_inputs import log_dataset_inputs
        from rayspeed.tracking.registry import bounded

        run_id = self.payload.mlflow_run_id
        if run_id is None:  # the run does not exist yet (server away at launch): the inputs are not recorded
            log.warning("MLflow: no run yet; the dataset inputs are not recorded for this attempt")
            return
        self.inputs_thread = threading.Thread(
            target=lambda: bounded(lambda: log_dataset_inputs(client, run_id, items), "dataset inputs", 120.0),
            name="rayspeed-dataset-inputs", daemon=True)
        self.inputs_thread.start()

    def log_preflight(self, report: Any) -> None:
        """Rank 0's tracker keeps the report (every other rank's is a NullLogger)."""
        self.tracker.log_text(json.dumps(report.to_json(), indent=2, default=str), "health/preflight.json")

    # ------------------------------------------------------------------ steps
    def should_log(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.cfg.train.max_steps

    def timed_step(self, step: int) -> Any:
        self.measuring = self.sample_comm(step)
        return self.comm.step(measure=self.measuring)

    def sample_comm(self, step: int) -> bool:
        """Whether the gradient-sync timer measures this step: the log step of a window that has other steps to
        time (the measured one is left out of the window's throughput); when the window is this step alone, only
        every COMM_SAMPLE_EVERY-th log step (that window then reports no throughput)."""
        if not self.should_log(step):
            return False
        return self.window.steps >= 1 or step % (COMM_SAMPLE_EVERY * self.log_every) == 0

    def first_step(self, step: int, state: dict[str, Any], engine: Any) -> None:
        """Once per attempt (a collective): model-state bytes of the real engine, and the recovery it closes."""
        from rayspeed.engine.state_bytes import model_state_bytes

        self.first_step_done = True
        now = time.time()
        # The optimizer state exists from the first step on.
        every = gather_objects(model_state_bytes(engine))
        self.model_state_bytes = {k: max(int(r[k]) for r in every) for k in every[0]}
        if not self.ctx.is_rank0:
            return
        self.tracker.log_metrics({f"memory/{k}_bytes": float(v) for k, v in self.model_state_bytes.items()}, step=step)
        log.info("first step done %.1f s after this attempt started", now - self.attempt_started)
        restarts = resilience.count_restarts(self.ctx.experiment_dir)
        self.restarts = restarts
        metrics: dict[str, float] = {"resilience/world_size": self.ctx.world_size, "resilience/restarts": restarts}
        # Whatever failed before (even before the first checkpoint): this first step ends its recovery.
        event = resilience.pending_event(self.ctx.experiment_dir)
        if event is not None:
            recovery = now - event["time"]
            progress = resilience.read_progress(self.ctx.experiment_dir)
            lost = max(0, int(progress.get("step", state["step"])) - state["step"])
            metrics.update({"resilience/recovery_s": recovery, "resilience/lost_steps": lost})
            cause = event.get("kind", "restart")
            if event.get("causes"):
                cause += ": " + "; ".join(f"rank {r}: {c}" for r, c in event["causes"].items())
            self.tracker.set_tags({f"rayspeed.restart.{restarts}": cause[:4000]})
            resilience.mark_recovered(self.ctx.experiment_dir,
                                      {"recovery_s": recovery, "lost_steps": lost, "step": step})
            log.info("recovered in %.1f s from %s (%d steps lost; this attempt started %.1f s after it)",
                     recovery, event.get("kind"), lost, self.attempt_started - event["time"])
            self.recovery_s = recovery
        self.tracker.log_metrics(metrics, step=step)

    def step_done(self, step: int, loss: torch.Tensor, state: dict[str, Any], engine: Any) -> None:
        self.window.add(loss, measured=self.measuring)
        self.measuring = False
        if not self.first_step_done:
            self.first_step(step, state, engine)
        if self.progress is not None:
            self.progress.update(step)

    def log_window(self, step: int, lr: float, grad_norm: Optional[float]) -> dict[str, float]:
        """Metrics at a log step: the loss (the step's only host read), throughput, gradient-sync fraction, MFU on
        GPU, and every rank's system metrics (a collective: all ranks call this). Restarts the window. Throughput
        (step time, tokens/s, MFU) comes from the window's steps the gradient-sync timer did not measure; a window
        without one reports none."""
        c, ctx, w = self.cfg, self.ctx, self.window
        step_time = w.step_time()
        mean_loss = self.dp_mean(w.loss / max(1, w.steps))
        metrics = {
            "train/loss": mean_loss,
            "train/lr": lr,
            "train/global_batch_size": c.train.global_batch_size,
            "resilience/world_size": ctx.world_size,
        }
        if step_time:
            tokens_per_s = c.train.global_batch_size * c.model.seq_len / step_time
            metrics.update({"perf/step_time_s": step_time, "perf/tokens_per_s": tokens_per_s})
            if self.peak_flops:
                metrics["perf/mfu"] = tokens_per_s * self.flops_per_token / (self.peak_flops * ctx.world_size)
        if grad_norm is not None:
            metrics["train/grad_norm"] = float(grad_norm)
        metrics.update(self.comm.metrics())
        if step_time:
            self.perf_windows.append((step - self.start_step, w.steps, step_time))
        metrics.update(plan_metrics(self.plan.best, self.perf_windows, worst_rank_peak_memory_gib(self.device)))
        if self.sampler is not None:
            from rayspeed.monitoring.system import gather_system_metrics

            snap = self.sampler.snapshot()
            last = self.comm.last()
            if last:
                snap["comm_s"] = last["comm_s"]
            system = gather_system_metrics(snap, self.groups, node_id=ctx.node_id)
            if system:
                metrics.update(system)
        if step > self.logged_until:  # a step replayed after a restart is already in the run's history
            self.tracker.log_metrics(metrics, step=step)
        self.last_loss = mean_loss
        log_rank(log, "step %d/%d loss %.4f lr %.2e %s s/step", step, c.train.max_steps, mean_loss, lr,
                 f"{step_time:.3f}" if step_time else "-")
        w.restart()
        return metrics

    def dp_mean(self, t: torch.Tensor) -> float:
        t = t.detach().clone().to(self.device, dtype=torch.float64)
        if self.groups.dp > 1:
            dist.all_reduce(t, group=self.groups.dp_group)
            t /= self.groups.dp
        return float(t.item())

    # ------------------------------------------------------------------ validation, checkpoints, the end
    def log_validation(self, step: int, val_loss: float) -> None:
        if step > self.logged_until:
            self.tracker.log_metrics({"val/loss": val_loss}, step=step)
        log_rank(log, "step %d val loss %.4f", step, val_loss)
        self.window.pause_excluded()

    def before_checkpoint(self) -> None:
        """Every step up to a checkpoint reaches MLflow before the checkpoint can commit (an async one commits in
        the background): a crash just after it loses no step that a resume from it would not re-run."""
        self.tracker.flush(5.0)

    def log_checkpoint(self, step: int, stall: float) -> None:
        """A save returned: `stall` is how long training was blocked (an async save's background write is logged
        by log_checkpoints_written when it commits)."""
        self.checkpoints += 1
        if step > self.logged_until:
            self.tracker.log_metrics({"checkpoint/stall_s": stall, "perf/checkpoint_stall_s": stall}, step=step)
        n = self.cfg.tracking.charts_every_checkpoints
        if self.charts is not None and n and self.checkpoints % n == 0 and step != self.cfg.train.max_steps:
            self.charts.publish()  # renders off the training thread
        self.window.pause_excluded()

    def log_checkpoints_written(self, records: list[dict[str, Any]]) -> None:
        """Saves that committed (CheckpointManager.poll): their write time (for an async save, the background part)
        and bytes, at the step of each save."""
        for r in records:
            if r["step"] > self.logged_until:
                self.tracker.log_metrics({"checkpoint/write_s": r["write_s"], "checkpoint/bytes": r["bytes"]},
                                         step=r["step"])

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tracker.set_tags(tags)

    def on_failure(self) -> None:
        """A peer died or a collective timed out: the metrics of the steps done so far are still in the logger's
        queue (it coalesces them); deliver them before Ray tears the group down."""
        if self.progress is not None:
            self.progress.close()
        if self.ctx.is_rank0:
            self.tracker.flush(5.0)

    def close(self, status: str) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.sampler is not None:
            self.sampler.stop()
        if self.ctx.is_rank0:
            if self.inputs_thread is not None:
                self.inputs_thread.join(60)
            self.tracker.set_tags({"rayspeed.status": status})
            self.tracker.close(timeout_s=120)
