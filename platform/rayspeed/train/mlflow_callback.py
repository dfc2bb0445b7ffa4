"""The job's one MLflow run, as seen from the workers: the start (params, tags, config and plan artifacts, the
dataset inputs), every log step's metrics, validation, checkpoints, the dashboard charts, and the end. The rank-0
gate is here: every other rank holds a NullLogger, so no caller checks ranks. A step already in the run's
history (replayed after a restart, or a resubmission) is not logged twice.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any, Optional

import torch

from rayspeed.config.load import flatten, to_dict, to_yaml
from rayspeed.config.schema import JobConfig
from rayspeed.tracking.spool import write_spool
from rayspeed.train import resilience
from rayspeed.train.deferred_run import DeferredRun, record_deferred_run
from rayspeed.train.events import Callback, TrainState

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


class MlflowCallback(Callback):
    def __init__(self, cfg: JobConfig, plan: Any, ctx: Any, payload: Any):
        from rayspeed.tracking.logger import MlflowLogger, NullLogger

        self.cfg, self.plan, self.ctx, self.payload = cfg, plan, ctx, payload
        self.tracker: Any = NullLogger()
        self.started = False
        if ctx.is_rank0 and (payload.mlflow_run_id or payload.tracking_deferred):
            try:
                # A server that did not answer at launch: the run is found or created once it does, and what was
                # logged meanwhile waits in the logger's queue.
                deferred = None if payload.mlflow_run_id else DeferredRun(cfg, payload, ctx.experiment_dir)
                self.tracker = MlflowLogger(payload.tracking_uri, payload.mlflow_run_id, run_factory=deferred,
                                            on_run=self._run_found,
                                            spool=functools.partial(write_spool, ctx.experiment_dir))
            except Exception as e:  # tracking must never kill training
                log.warning("MLflow unavailable (%s): training continues without tracking", e)
        self.charts: Any = None
        self.checkpoints = 0
        self._logged_until: Optional[int] = None if ctx.is_rank0 else 0
        self.inputs_thread: Any = None
        self.ds_config: dict[str, Any] = {}
        self.node_ids: list[Any] = []
        self.data_inputs: list[dict[str, Any]] = []

    @property
    def logged_until(self) -> int:
        """Steps already in the run's history (a replay after a restart, or a resubmission): not logged twice.
        Asked at the first log step, not at the start: the question opens the MLflow store, which rank 0 then
        does beside its first steps instead of before them (rayspeed.tracking.logger's client)."""
        if self._logged_until is None:
            self._logged_until = int(self.tracker.last_step("train/loss"))
        return self._logged_until

    def _run_found(self, run_id: str) -> None:
        """The deferred run exists (called on the logger's thread): charts and registration can use it now."""
        if self.payload.mlflow_run_id == run_id:
            return
        self.payload.mlflow_run_id = run_id
        record_deferred_run(self.ctx.experiment_dir, run_id)
        if self.started and self.charts is None:
            from rayspeed.tracking.charts import ChartPublisher

            self.charts = ChartPublisher(self.tracker, self.payload.tracking_uri, run_id)

    def describe(self, ds_config: dict[str, Any], node_ids: list[Any], data_inputs: list[dict[str, Any]]) -> None:
        """What the start records besides the job and the plan (known once the engine and the data are built)."""
        self.ds_config, self.node_ids, self.data_inputs = ds_config, node_ids, data_inputs

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tracker.set_tags(tags)

    def log_preflight(self, report: Any) -> None:
        self.tracker.log_text(json.dumps(report.to_json(), indent=2, default=str), "health/preflight.json")

    # ------------------------------------------------------------------ events
    def on_start(self, state: TrainState) -> None:
        self.started = True
        if self.ctx.is_rank0 and self.payload.mlflow_run_id:
            from rayspeed.tracking.charts import ChartPublisher

            self.charts = ChartPublisher(self.tracker, self.payload.tracking_uri, self.payload.mlflow_run_id)
        self._log_start(state)
        self._log_data_inputs()

    def on_log(self, state: TrainState, metrics: dict[str, float]) -> None:
        if state.step > self.logged_until:
            self.tracker.log_metrics(metrics, step=state.step)

    def on_validation(self, state: TrainState, val_loss: float) -> None:
        if state.step > self.logged_until:
            self.tracker.log_metrics({"val/loss": val_loss}, step=state.step)

    def on_before_checkpoint(self, state: TrainState) -> None:
        """Every step up to a checkpoint reaches MLflow before the checkpoint can commit (an async one commits in
        the background): a crash just after it loses no step that a resume from it would not re-run."""
        self.tracker.deliver(5.0)

    def on_checkpoint_saved(self, state: TrainState, stall_s: float) -> None:
        """A save returned: `stall_s` is how long training was blocked."""
        step = state.step
        self.checkpoints += 1
        if step > self.logged_until:
            self.tracker.log_metrics({"checkpoint/stall_s": stall_s, "perf/checkpoint_stall_s": stall_s}, step=step)
        n = self.cfg.tracking.charts_every_checkpoints
        if self.charts is not None and n and self.checkpoints % n == 0 and step != self.cfg.train.max_steps:
            self.charts.publish()  # renders off the training thread

    def on_checkpoint_committed(self, state: TrainState, record: dict[str, Any]) -> None:
        """Its write time (an async save's background part) and bytes, at the step of the save."""
        if record["step"] > self.logged_until:
            self.tracker.log_metrics({"checkpoint/write_s": record["write_s"], "checkpoint/bytes": record["bytes"]},
                                     step=record["step"])

    def on_end(self, state: TrainState) -> None:
        self.close("finished")

    def on_failure(self, state: TrainState, error: BaseException) -> None:
        """A peer died or a collective timed out: the metrics of the steps done so far are still in the logger's
        queue (it coalesces them); deliver them before Ray tears the group down."""
        if self.ctx.is_rank0:
            self.tracker.deliver(5.0)

    def close(self, status: str) -> None:
        if self.ctx.is_rank0:
            if self.inputs_thread is not None:
                self.inputs_thread.join(60)
            self.tracker.set_tags({"rayspeed.status": status})
            self.tracker.close(timeout_s=120)

    # ------------------------------------------------------------------ the start
    def _log_start(self, state: TrainState) -> None:
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

            params.update(lineage_params(self.node_ids, use_gpu=c.cluster.use_gpu))
        except Exception as e:
            log.warning("lineage params unavailable: %s", e)
        t.log_params(params)
        t.set_tags({"rayspeed.job": c.name, "rayspeed.status": "running", "rayspeed.world_size": str(world)})
        t.log_text(to_yaml(c), "config/resolved.yaml")
        t.log_text(json.dumps(self.ds_config, indent=2, sort_keys=True), "config/deepspeed.json")
        t.log_text(json.dumps(plain(self.plan.to_json()), indent=2, default=str), "plan/plan.json")
        t.log_text(self.plan.explain, "plan/explain.txt")
        t.log_metrics({"resilience/world_size": world,
                       "resilience/restarts": resilience.count_restarts(self.ctx.experiment_dir)}, step=state.step)
        p = c.parallel
        log.info("plan: dp=%s cp=%s tp=%s pp=%s ep=%s zero=%s micro=%s accum=%s ac=%s precision=%s global_batch=%s "
                 "(world %d)", p.dp, p.cp, p.tp, p.pp, p.ep, p.zero_stage, p.micro_batch_size, p.grad_accum,
                 p.activation_checkpointing, c.train.precision, c.train.global_batch_size, world)

    def _log_data_inputs(self) -> None:
        """The training and validation data as the run's MLflow dataset inputs (rank 0, in the background: tracking
        never holds up training; close() waits for it a little)."""
        items = self.data_inputs
        if not self.ctx.is_rank0 or not hasattr(type(self.tracker), "client") or not items:
            return
        import threading

        from rayspeed.tracking.dataset_inputs import log_dataset_inputs
        from rayspeed.tracking.registry import bounded

        run_id: Optional[str] = self.payload.mlflow_run_id
        if run_id is None:  # the run does not exist yet (server away at launch): the inputs are not recorded
            log.warning("MLflow: no run yet; the dataset inputs are not recorded for this attempt")
            return
        self.inputs_thread = threading.Thread(
            target=lambda: bounded(lambda: log_dataset_inputs(self.tracker.client, run_id, items), "dataset inputs",
                                   120.0),
            name="rayspeed-dataset-inputs", daemon=True)
        self.inputs_thread.start()
