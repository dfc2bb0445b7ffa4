"""The trainer of one attempt: built for the world this attempt got, it sets up data, engine and resume, then
runs the loop. Each component owns its cadence and its rank-0 logic (the checkpoint manager, the reporter, the
validator, the chaos drills, the watchdog); the loop only calls them."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from rayspeed import paths, storage
from rayspeed.checkpoint import manifest, rng
from rayspeed.checkpoint.manager import CheckpointManager
from rayspeed.config.layout import Layout
from rayspeed.config.load import parse
from rayspeed.config.schema import JobConfig
from rayspeed.data.token_split import IGNORE_INDEX
from rayspeed.logs import log_rank
from rayspeed.parallel.groups import ParallelGroups
from rayspeed.parallel.objects import gather_objects
from rayspeed.train.chaos import ChaosDrills
from rayspeed.train.evaluation import Validator, stage_inputs
from rayspeed.train.payload import LaunchPayload, RunResult
from rayspeed.train.reporting import Reporter
from rayspeed.train.resume_guard import run_identity

log = logging.getLogger("rayspeed.worker")


class Trainer:
    def __init__(self, cfg: JobConfig, plan: Any, ctx: Any, payload: LaunchPayload, chosen: Optional[str],
                 meta: Optional[dict[str, Any]], phases: dict[str, float], attempt_started: float):
        c = cfg
        self.cfg, self.plan, self.ctx, self.payload = cfg, plan, ctx, payload
        self.phases = phases
        self.device = torch.device("cuda", torch.cuda.current_device()) if c.cluster.use_gpu else torch.device("cpu")
        # Process groups are built once and passed explicitly to everything that communicates.
        self.groups = ParallelGroups(c.parallel.dp, c.parallel.tp, c.parallel.pp)
        self.chaos = ChaosDrills(c.chaos, ctx.rank, ctx.experiment_dir)
        self.checkpointer = CheckpointManager(c, ctx, chosen, meta, payload.mlflow_run_id, self.chaos,
                                              identity=run_identity(parse(payload.job)),
                                              snapshot_plan=plan.best.get("checkpoint"))
        self.reporter = Reporter(c, plan, ctx, payload, self.groups, self.device, attempt_started)
        from rayspeed.health.watchdog import Watchdog

        self.watchdog = Watchdog.from_config(c.health)
        self.state: dict[str, Any] = {"step": 0, "restarts": 0}
        self.node_ids: list[Any] = []
        self.ds_config: dict[str, Any] = {}
        self.engine: Any = None
        self.pipelined = False
        self.clipper: Any = None
        self.guard: Any = None
        self.grad_norm: Optional[torch.Tensor] = None
        self.train_split: Any = None
        self.batches: Any = None
        self.validator_batches: list[Any] = []
        self.validator: Optional[Validator] = None
        self.data_inputs: list[dict[str, Any]] = []

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
        self.engine, self.pipelined = build_engine(c, self.ds_config, self.groups, self.device)
        if rayspeed_clips(c):
            from rayspeed.engine.clip import GradClipper

            self.clipper = GradClipper(self.engine.module.parameters(), c.train.grad_clip, self.groups.tp_group)
        self.validator = Validator(c, self.validator_batches, self.device, self.pipelined, self.reporter.dp_mean,
                                   weighted=self.batches.weighted)
        if c.health.watchdog != "off":
            from rayspeed.train.step_guard import StepGuard

            self.guard = StepGuard(self.watchdog, self.engine, self.groups, self._own_norm)
        phases["engine"] = time.time() - t
        t = time.time()
        client = self.checkpointer.load(self.engine)
        if client is not None:
            self._restore_data_position(client["data"])
            self.state = {"step": int(client["step"]), "restarts": int(client.get("restarts", 0)) + 1,
                          "resumed_from": self.checkpointer.chosen}
        phases["resume"] = time.time() - t
        t = time.time()
        if c.health.preflight:
            failed = self._preflight()
            if failed is not None:
                return failed
        phases["preflight"] = time.time() - t
        self.reporter.start_monitors()
        log_rank(log, "startup: %s", ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
        self.reporter.log_start(self.state, self.ds_config, self.node_ids)
        self.reporter.log_data_inputs(self.data_inputs)
        return None

    def _check_topology(self) -> None:
        """tp groups must sit on one node: Ray Train places a node's workers on consecutive ranks (verified here,
        not assumed)."""
        self.node_ids = gather_objects(self.ctx.node_id)
        if self.cfg.parallel.tp <= 1 or not self.ctx.under_ray:
            return
        from rayspeed.parallel.groups import check_tp_within_nodes

        check_tp_within_nodes(self.node_ids, self.cfg.parallel.tp)

    def _build_data(self) -> None:
        from rayspeed.data import RankBatches, make_schedule, val_batches
        from rayspeed.train import data_setup

        c, g, dm = self.cfg, self.groups, self.cfg.data.document_masking
        corpus = data_setup.load_corpus(c, self.payload.storage_path)  # the launcher tokenized it: a cache hit
        train, val = data_setup.splits(corpus, c)
        schedule = make_schedule(train, c.model.seq_len, c.train.global_batch_size, c.train.seed)
        self.train_split = train
        self.batches = RankBatches(train, c.model.seq_len, schedule, g.dp_rank, g.dp, c.parallel.micro_batch_size,
                                   c.parallel.grad_accum, document_masking=dm)
        share = c.parallel.micro_batch_size * c.parallel.grad_accum
        self.validator_batches = val_batches(val, c.model.seq_len, share, c.train.eval_batches, g.dp_rank, g.dp, dm)
        self.data_inputs = data_setup.dataset_inputs(corpus, c) if self.ctx.is_rank0 else []
        log_rank(log, "data: %s; %d training sequences of %d tokens", corpus, schedule.num_sequences, c.model.seq_len)

    def _restore_data_position(self, data_state: dict[str, Any]) -> None:
        from rayspeed.data import GlobalBatchSchedule, RankBatches

        step = int(data_state["step"])
        if int(data_state.get("global_batch_size", -1)) == self.cfg.train.global_batch_size:
            self.batches.load_state_dict(data_state)
            return
        # The global batch changed (playbook batch policy): the sample stream continues where it stopped.
        c, g = self.cfg, self.groups
        old = self.batches.schedule
        schedule = GlobalBatchSchedule(old.num_sequences, c.train.global_batch_size, old.seed, start_step=step,
                                       start_sample=int(data_state["consumed_samples"]))
        self.batches = RankBatches(self.train_split, c.model.seq_len, schedule, g.dp_rank, g.dp,
                                   c.parallel.micro_batch_size, c.parallel.grad_accum, start_step=step,
                                   document_masking=self.batches.document_masking,
                                   label_counts=self.batches.label_counts)

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
                self.reporter.set_tags({"rayspeed.preflight": e.reason[:4000]})
                self.reporter.close("preflight_failed")
                self._write_result(result)
            return result
        self.reporter.log_preflight(report)
        return None

    # ------------------------------------------------------------------ the loop
    def run(self) -> RunResult:
        failed = self.setup()
        if failed is not None:
            return failed
        try:
            return self.train()
        except BaseException:
            self.reporter.on_failure()
            raise

    def train(self) -> RunResult:
        c, start = self.cfg, self.state["step"]
        val_loss: Optional[float] = None
        self.reporter.start_step = start
        self.engine.train()
        for step, micro in self.batches.iterate(start, c.train.max_steps - start):
            done = step + 1
            self.chaos.at_step(done)
            with self.reporter.timed_step(done):
                loss = self.train_step(micro, self.loss_scale(step), done)
            self._guarded(done)
            self.reporter.step_done(done, loss, self.state, self.engine)
            if self.reporter.should_log(done):
                self.reporter.log_window(done, self.lr(), self.global_grad_norm())
            if self.validator.should_validate(done):
                val_loss = self.validator.run(self.engine)
                self.reporter.log_validation(done, val_loss)
            if self.checkpointer.should_save(done):
                self.reporter.before_checkpoint()
                stall = self.checkpointer.save(done, self.engine, self.client_state(done))
                self.reporter.log_checkpoint(done, stall)
            self.reporter.log_checkpoints_written(self.checkpointer.poll())  # async: when the background commits
        self.checkpointer.drain()  # the last save commits before the outputs
        self.reporter.log_checkpoints_written(self.checkpointer.poll())
        return self.finish(val_loss)

    def loss_scale(self, step: int) -> Optional[float]:
        """With ignored labels (chat, document masking) the loss of a step is the mean over the counted labels of
        its whole global batch, whatever micro-batch or rank they fall in: each micro-batch's summed loss is scaled
        by dp * grad_accum / (counted labels of the global batch), which DeepSpeed's averaging over accumulation
        and data-parallel ranks turns into exactly that mean. None: every label counts (the plain mean)."""
        if not self.batches.weighted:
            return None
        return self.groups.dp * self.cfg.parallel.grad_accum / max(1, self.batches.step_tokens(step))

    def train_step(self, micro_batches: list, scale: Optional[float] = None, step: int = 0) -> torch.Tensor:
        eng = self.engine
        poison = self.chaos.poisons_loss(step)
        if self.pipelined:
            if scale is not None:
                eng.module.loss_fn.scale = scale
            if poison:  # the loss lives on the last stage: a rank of another stage poisons nothing
                eng.module.loss_fn.scale = float("nan")
            if self.guard is not None:
                self.guard.arm(step, None)
            batches = [(stage_inputs(mb, self.device), mb[1].to(self.device)) for mb in micro_batches]
            loss = eng.train_batch(iter(batches)).float().mean()
            if poison:
                eng.module.loss_fn.scale = scale
            return loss
        total = torch.zeros((), device=self.device)
        for mb in micro_batches:
            x, y = mb[0].to(self.device, non_blocking=True), mb[1].to(self.device, non_blocking=True)
            loss = eng(x, y, *(t.to(self.device, non_blocking=True) for t in mb[2:]))
            if scale is not None:  # mean over this micro-batch's counted labels -> its share of the step's mean
                loss = loss * (int((mb[1] != IGNORE_INDEX).sum()) * scale)
            if poison:
                loss = loss * float("nan")
            eng.backward(loss)
            total += loss.detach().float()
            if eng.is_gradient_accumulation_boundary():
                if self.clipper is not None:
                    self.grad_norm = self.clipper()  # gradients are all-reduced by now
                if self.guard is not None:
                    self.guard.arm(step, total / len(micro_batches))
            eng.step()
        return total / len(micro_batches)

    def client_state(self, step: int) -> dict[str, Any]:
        """What a checkpoint carries besides the engine's state: the step, the data position, the restarts."""
        return {"step": step, "data": self.batches.state_dict(), "restarts": self.state["restarts"]}

    def lr(self) -> float:
        return float(self.engine.optimizer.param_groups[0]["lr"]) if self.pipelined else float(self.engine.get_lr()[0])

    def global_grad_norm(self) -> Optional[float]:
        gn = self.grad_norm if self.clipper is not None else self.engine.get_global_grad_norm()
        return None if gn is None else float(gn)

    def _own_norm(self) -> Optional[torch.Tensor]:
        """The step's global gradient norm where no DeepSpeed wrapper computes one (ZeRO-0 fp32): the clipper's, or
        computed over this rank's gradients and summed over tensor- and pipeline-parallel ranks."""
        if self.clipper is not None:
            return self.grad_norm
        from rayspeed.engine.clip import global_grad_norm

        return global_grad_norm(self.engine.module.parameters(), self.groups.tp_group, self.groups.pp_group)

    def _guarded(self, step: int) -> None:
        """After the step: act on what the guard decided before its update (it was withheld unless ok)."""
        decision = self.guard.settle() if self.guard is not None else None
        if decision is None or decision.ok:
            return
        if decision.action == "skip":
            self.reporter.set_tags({f"rayspeed.watchdog.step{step}": f"skipped: {decision.reason}"[:4000]})
            return
        chosen = self.checkpointer.rollback(self.engine)
        if chosen is None:
            log_rank(log, "watchdog: %s, but no verified checkpoint to roll back to; the update was not applied, "
                     "continuing", decision.reason, level=logging.WARNING)
            return
        # Continue with the data after the bad window: replaying it would reproduce the same blow-up.
        self.watchdog.reset()
        name = manifest.name_of(chosen)
        log_rank(log, "watchdog: %s -> rolled back to %s, skipping the data of steps %d..%d", decision.reason, name,
                 (manifest.step_of(chosen) or 0) + 1, step, level=logging.WARNING)
        self.reporter.set_tags({f"rayspeed.watchdog.step{step}": f"rollback to {name}: {decision.reason}"[:4000]})

    # ------------------------------------------------------------------ the end
    def finish(self, val_loss: Optional[float]) -> RunResult:
        from rayspeed.train.outputs import finish_outputs

        c, last_loss = self.cfg, self.reporter.last_loss
        version = finish_outputs(self, val_loss, last_loss)
        result = RunResult(
            status="finished", steps=c.train.max_steps, final_loss=last_loss, val_loss=val_loss,
            restarts=self.reporter.restarts, world_size=self.ctx.world_size,
            global_batch_size=c.train.global_batch_size, recovery_s=self.reporter.recovery_s,
            checkpoint_stall_s=self.checkpointer.median_stall(), checkpoint_write_s=self.checkpointer.median_write(),
            checkpoint_bytes=self.checkpointer.last_bytes, model_state_bytes=self.reporter.model_state_bytes,
            layout=Layout.from_parallel(c.parallel).record(), registered_model_version=version)
        self.reporter.close("finished")
        result.mlflow_run_id = self.payload.mlflow_run_id  # after close: a deferred run exists once flushed
        if self.ctx.is_rank0:
            self._write_result(result)
        return result

    def _write_result(self, result: RunResult) -> None:
        storage.locate(self.ctx.experiment_dir).write_json(paths.WORKER_RESULT, result.to_json())
