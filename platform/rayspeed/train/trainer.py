"""The trainer of one attempt: built for the world this attempt got, it sets up data, engine and resume, wires
the step, the checkpoint cadence and the callbacks (rayspeed.train.events), and hands them to the loop
(rayspeed.train.loop). Each component owns its cadence and its rank-0 logic; the loop only calls them."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from rayspeed.checkpoint import rng
from rayspeed.checkpoint.cadence import Cadence
from rayspeed.checkpoint.manager import CheckpointManager
from rayspeed.config.layout import Layout
from rayspeed.config.load import parse
from rayspeed.config.schema import JobConfig
from rayspeed.config.shape import ModelShape
from rayspeed.errors import FinalError
from rayspeed.logs import log_rank
from rayspeed.parallel.groups import ParallelGroups
from rayspeed.parallel.objects import gather_objects
from rayspeed.train.chaos import ChaosDrills
from rayspeed.train.evaluation import ValidationCallback
from rayspeed.train.events import Callbacks, TrainState, load_callback
from rayspeed.train.features import FEATURES
from rayspeed.train.loop import run_loop
from rayspeed.train.metrics_callback import MetricsCallback
from rayspeed.train.mlflow_callback import MlflowCallback
from rayspeed.train.outputs import OutputsCallback
from rayspeed.train.payload import LaunchPayload, RunResult
from rayspeed.train.recovery import RecoveryCallback
from rayspeed.train.resume_guard import run_identity
from rayspeed.train.step import StepReadings, TrainStep
from rayspeed.train.step_guard import NO_GUARD, StepGuard

log = logging.getLogger("rayspeed.worker")


class Trainer:
    def __init__(self, cfg: JobConfig, plan: Any, ctx: Any, payload: LaunchPayload, chosen: Optional[str],
                 meta: Optional[dict[str, Any]], phases: dict[str, float], attempt_started: float):
        c = cfg
        self.cfg, self.plan, self.ctx, self.payload = cfg, plan, ctx, payload
        self.phases = phases
        self.device = torch.device("cuda", torch.cuda.current_device()) if c.cluster.use_gpu else torch.device("cpu")
        # Process groups are built once and passed explicitly to everything that communicates.
        par = c.parallel  # the attempt's resolved layout: the planner left no auto
        assert isinstance(par.dp, int) and isinstance(par.tp, int) and isinstance(par.pp, int)
        assert isinstance(par.cp, int) and isinstance(par.ep, int)
        self.groups = ParallelGroups(par.dp, par.tp, par.pp, cp=par.cp, cp_scheme=par.cp_scheme, ep=par.ep)
        self.shape = ModelShape.from_config(c.model)  # the attempt's, once: the engine and the metrics read it
        self.chaos = ChaosDrills(c.chaos, ctx.rank, ctx.experiment_dir)
        self.checkpointer = CheckpointManager(c, ctx, chosen, meta, payload.mlflow_run_id, self.chaos,
                                              identity=payload.run_identity or run_identity(parse(payload.job)),
                                              snapshot_plan=plan.best.get("checkpoint"))
        self.attempt_started = attempt_started
        self.mlflow = MlflowCallback(c, plan, ctx, payload)
        from rayspeed.health.watchdog import Watchdog

        self.watchdog = Watchdog.from_config(c.health)
        self.state: dict[str, Any] = {"step": 0, "restarts": 0}
        self.node_ids: list[Any] = []
        self.ds_config: dict[str, Any] = {}
        self.engine: Any = None
        self.pipelined = False
        self.clipper: Any = None
        self.batches: Any = None
        self.validator_batches: list[Any] = []
        self.validator: Any = None
        self.data_inputs: list[dict[str, Any]] = []
        self.data: Any = None  # the objective's data (rayspeed.train.sft_setup.OBJECTIVE_DATA)
        self.objective: Any = None  # rayspeed.train.objective: the language model's, or a DPO job's

    # ------------------------------------------------------------------ setup
    def setup(self) -> Optional[RunResult]:
        """Data, engine, resume, preflight and monitors; a RunResult only when the preflight failed."""
        from rayspeed.engine.build import build_engine
        from rayspeed.engine.deepspeed_config import deepspeed_config, rayspeed_clips

        c, phases = self.cfg, self.phases
        t = time.time()
        rng.seed_all(c.train.seed)
        self._check_topology()
        self._build_data()
        phases["groups_and_data"] = time.time() - t
        t = time.time()
        self.ds_config = self.checkpointer.prepare(deepspeed_config(c, self.plan.best))
        self.engine, self.pipelined = build_engine(c, self.ds_config, self.groups, self.device, self.shape)
        if rayspeed_clips(c):
            from rayspeed.engine.clip import GradClipper

            self.clipper = GradClipper(self.engine.module.parameters(), c.train.grad_clip, self.groups.tp_group)
        self.objective = self._objective()
        self.validator = self.objective.validator
        phases["engine"] = time.time() - t
        t = time.time()
        client = self.checkpointer.load(self.engine)
        if client is not None:
            self._restore_data_position(client["data"])
            self.state = {"step": int(client["step"]), "restarts": int(client.get("restarts", 0)) + 1,
                          "resumed_from": self.checkpointer.chosen, "losses": client.get("losses", {})}
        phases["resume"] = time.time() - t
        t = time.time()
        if c.health.preflight:
            failed = self._preflight()
            if failed is not None:
                return failed
        phases["preflight"] = time.time() - t
        log_rank(log, "startup: %s", ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
        self.mlflow.describe(self.ds_config, self.node_ids, self.data_inputs)
        return None

    def _objective(self) -> Any:
        # A DPO reference comes from the initial weights: this runs before any checkpoint is loaded.
        return self.data.objective(self.engine, self.device, self.pipelined)

    def _check_topology(self) -> None:
        """tp groups must sit on one node: Ray Train places a node's workers on consecutive ranks (verified here,
        not assumed)."""
        self.node_ids = gather_objects(self.ctx.node_id)
        assert isinstance(self.cfg.parallel.tp, int)  # resolved: the groups were built with it
        if self.cfg.parallel.tp <= 1 or not self.ctx.under_ray:
            return
        from rayspeed.parallel.groups import check_tp_within_nodes

        check_tp_within_nodes(self.node_ids, self.cfg.parallel.tp)

    def _build_data(self) -> None:
        from rayspeed.train import data_setup
        from rayspeed.train.sft_setup import objective_data

        self.data = objective_data(self.cfg, self.groups, self.payload.storage_path)
        self.batches, self.validator_batches = self.data.batches, self.data.validator_batches
        self.data_inputs = data_setup.dataset_inputs(self.data.corpus, self.cfg) if self.ctx.is_rank0 else []

    def _restore_data_position(self, data_state: dict[str, Any]) -> None:
        from rayspeed.data import GlobalBatchSchedule

        step = int(data_state["step"])
        if int(data_state.get("global_batch_size", -1)) == self.cfg.train.global_batch_size:
            self.batches.load_state_dict(data_state)
            return
        # The global batch changed (playbook batch policy): the sample stream continues where it stopped.
        c = self.cfg
        old = self.batches.schedule
        schedule = GlobalBatchSchedule(old.num_sequences, c.train.global_batch_size, old.seed, start_step=step,
                                       start_sample=int(data_state["consumed_samples"]))
        self.batches = self.data.rebatched(schedule, step)

    def _preflight(self) -> Optional[RunResult]:
        """Bandwidth and environment checks on the job's own workers before step 0. A failure ends the job at once
        (no restarts: the same cluster would fail the same way), with the reason in the result."""
        from rayspeed.health.preflight import PreflightError, run_preflight

        try:
            report = run_preflight(self.cfg, self.groups, self.device)
        except PreflightError as e:
            result = RunResult(status="preflight_failed", error=e.reason, world_size=self.ctx.world_size)
            if self.ctx.is_rank0:
                log.error("preflight failed: %s", e.reason)
                self.mlflow.set_tags({"rayspeed.preflight": e.reason[:4000]})
                self.mlflow.close("preflight_failed")
            return result
        self.mlflow.log_preflight(report)
        return None

    # ------------------------------------------------------------------ the loop
    def run(self) -> RunResult:
        failed = self.setup()
        if failed is not None:
            return failed
        return self.train()

    def callbacks(self, readings: StepReadings) -> tuple[Callbacks, MetricsCallback]:
        """The listeners, in the order step_end reaches them (end and failure: reversed, so the tracker closes
        last): the tracker, what the objective and the model's features add (the tracker's last artifact goes
        before the run closes), recovery accounting, the job's own (train.callbacks: at the end they see the
        registered model), the outputs, then the producers of the log and validation events (after every step_end
        listener: a step ends before what it produces)."""
        c, ctx, events = self.cfg, self.ctx, Callbacks()
        tracker = self.mlflow.tracker
        metrics = MetricsCallback(c, self.plan, ctx, self.groups, self.device, events, tracker, readings.lr,
                                  readings.global_grad_norm, engine=self.engine, shape=self.shape)
        added = [self.objective.listeners(tracker, lambda: self.mlflow.logged_until),
                 *(feature(self, tracker) for feature in FEATURES)]
        metrics.sources += [source for listeners in added for source in listeners.metrics]
        for cb in (self.mlflow, *(cb for listeners in added for cb in listeners.callbacks),
                   RecoveryCallback(ctx, tracker, self.attempt_started, self.phases, self.payload),
                   *(load_callback(name) for name in c.train.callbacks),
                   OutputsCallback(c, ctx, self.payload, self.engine, self.groups, self.device, self.checkpointer,
                                   self.validator_batches, self.mlflow),
                   metrics, ValidationCallback(self.validator, self.engine, events)):
            events.add(cb)
        return events, metrics

    def train(self) -> RunResult:
        c, start = self.cfg, self.state["step"]
        state = TrainState(max_steps=c.train.max_steps, rank=self.ctx.rank, world_size=self.ctx.world_size,
                           step=start, start_step=start, restarts=self.state["restarts"],
                           resumed_from=self.state.get("resumed_from"))
        losses = self.state.get("losses", {})  # a checkpoint from before they were kept has none
        state.last_loss, state.val_loss = losses.get("last", state.last_loss), losses.get("val")
        readings = StepReadings(self.engine, self.pipelined, self.clipper, self.groups)
        events, metrics = self.callbacks(readings)
        step = TrainStep(self.engine, self.objective, readings, self._guard(readings), self.chaos, metrics,
                         self.device, self.pipelined)
        saves = Cadence(self.checkpointer, self.engine, self.client_state, events)
        try:
            events.start(state)
        except BaseException as e:
            events.failure(state, e)
            raise
        self.engine.train()
        try:
            run_loop(self.batches.iterate(start, c.train.max_steps - start), step, saves, events, state)
        except FinalError as e:  # raised on every rank at once (its callbacks heard it): a restart would repeat it
            if self.ctx.is_rank0:
                log.error("%s: %s", e.status, e)
                self.mlflow.set_tags({"rayspeed.failure": str(e)[:4000]})
                self.mlflow.close(e.status)
            return RunResult(status=e.status, error=str(e), steps=state.step, world_size=self.ctx.world_size,
                             mlflow_run_id=self.payload.mlflow_run_id)
        return self.result(state)

    def _guard(self, readings: StepReadings) -> Any:
        if self.cfg.health.watchdog == "off":
            return NO_GUARD
        return StepGuard(self.watchdog, self.engine, self.groups, readings.own_norm, self.checkpointer,
                         self.mlflow.set_tags)

    def client_state(self, state: TrainState) -> dict[str, Any]:
        """What a checkpoint carries besides the engine's state: the step, the data position, the restarts, and the
        losses so far (a resubmission that finds the job done reports them, not NaN)."""
        return {"step": state.step, "data": self.batches.state_dict(), "restarts": self.state["restarts"],
                "losses": {"last": state.last_loss, "val": state.val_loss}}

    # ------------------------------------------------------------------ the end
    def result(self, state: TrainState) -> RunResult:
        c = self.cfg
        result = RunResult(
            status="finished", steps=c.train.max_steps, final_loss=state.last_loss, val_loss=state.val_loss,
            restarts=state.restarts_seen, world_size=self.ctx.world_size,
            global_batch_size=c.train.global_batch_size, recovery_s=state.recovery_s,
            checkpoint_stall_s=self.checkpointer.median_stall(), checkpoint_write_s=self.checkpointer.median_write(),
            checkpoint_bytes=self.checkpointer.last_bytes, model_state_bytes=state.model_state_bytes,
            layout=Layout.from_parallel(c.parallel).record(), registered_model_version=state.registered_model_version)
        result.mlflow_run_id = self.payload.mlflow_run_id  # after close: a deferred run exists once flushed
        return result
