"""The worker loop: the same function under Ray Train (one per worker) and in-process (--launcher local).

At every (re)start each worker: joins the process group, agrees with the others on the newest verified
checkpoint, re-plans for the world size it actually got (tp and pp kept from the checkpoint, dp and
accumulation recomputed, the batch policy applied), builds the model and the DeepSpeed engine, resumes
(through a universal checkpoint when the ZeRO layout changed) and trains. Rank 0 alone talks to MLflow.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rayspeed.checkpoint import resume as ckpt_resume
from rayspeed import paths, storage
from rayspeed.checkpoint import manifest, staging
from rayspeed.config.layout import Layout
from rayspeed.health.calibration import worst_rank_peak_memory_gib
from rayspeed.planner.feedback import plan_metrics
from rayspeed.config.load import flatten, parse, to_dict, to_yaml
from rayspeed.config.schema import AUTO, JobConfig
from rayspeed.train import resilience
from rayspeed.train.context import WorkerContext

log = logging.getLogger("rayspeed.worker")


def _setup_logging(rank: int) -> None:
    from rayspeed.logs import setup

    setup(f"rayspeed rank {rank}")


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train's train_loop_per_worker."""
    from rayspeed.train.context import ray_context

    run_worker(config, ray_context())


def _broadcast(obj: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _pin_model_parallel(job: JobConfig, manifest: dict[str, Any] | None) -> JobConfig:
    """On resume, tp and pp stay what the checkpoint was written with (a model-parallel reshard is not a
    restart's job); dp and accumulation are re-planned for the new world."""
    if not manifest:
        return job
    old = manifest.get("layout") or {}
    par = job.parallel
    pinned = {k: int(old[k]) for k in ("tp", "pp") if getattr(par, k) == AUTO and k in old}
    if old.get("stage_layers") and getattr(par, "stage_layers", None) is None:  # the pipeline split too
        pinned["stage_layers"] = [int(n) for n in old["stage_layers"]]
    return dataclasses.replace(job, parallel=dataclasses.replace(par, **pinned)) if pinned else job


def _skip_shm_comm_op() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op (used by its inference all-reduce,
    not by training's gloo collectives) at init_distributed: a C++ build on every fresh machine (measured
    ~60 s) and a lock every worker waits on. Marking the op incompatible skips it."""
    try:
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is not None:
            deepspeed.ops.__compatible_ops__[builder.NAME] = False
    except Exception as e:  # an older/newer DeepSpeed without it: nothing to skip
        log.debug("shm comm op not skipped: %s", e)


def run_worker(config: dict[str, Any], ctx: WorkerContext) -> dict[str, Any]:
    t_start = time.time()
    import deepspeed

    from rayspeed.planner import resolve

    _setup_logging(ctx.rank)
    phases = {"imports": time.time() - t_start}
    job = parse(config["job"])
    backend = "nccl" if job.cluster.use_gpu else "gloo"
    if not job.cluster.use_gpu:
        _skip_shm_comm_op()
    t = time.time()
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    phases["init_distributed"] = time.time() - t
    if paths.is_uri(config.get("experiment_dir")):
        # Ray hands workers the path inside its filesystem (bucket/prefix/name); rayspeed keeps the URI form.
        ctx = dataclasses.replace(ctx, experiment_dir=config["experiment_dir"])
    exp = storage.locate(ctx.experiment_dir)
    chosen = None
    if ctx.is_rank0:
        preferred = None
        if ctx.under_ray:
            import ray.train

            ck = ray.train.get_checkpoint()
            preferred = ck.path if ck is not None else None
            if preferred and not exp.is_local:
                preferred = str(exp.child(preferred.rstrip("/").rsplit("/", 1)[-1]))
        found = ckpt_resume.choose(ctx.experiment_dir, preferred, deep=exp.is_local)
        chosen = str(found) if found else None
    chosen = _broadcast(chosen)
    meta = manifest.read_manifest(chosen) if chosen else None
    job, policy_line = resilience.apply_batch_policy(_pin_model_parallel(job, meta), ctx.world_size)
    # The user's job (with its "auto"s) is re-planned here, for the world this attempt actually got.
    cfg, plan = resolve(job, world_size=ctx.world_size)
    if ctx.is_rank0:
        log.info(policy_line)
    trainer = Trainer(cfg, plan, ctx, config, chosen, meta, t_start)
    trainer.phases = phases
    return trainer.run()


class Trainer:
    def __init__(self, cfg: JobConfig, plan: Any, ctx: WorkerContext, launch: dict[str, Any],
                 checkpoint: str | None = None, manifest: dict[str, Any] | None = None, t_start: float | None = None):
        self.cfg, self.plan, self.ctx, self.launch = cfg, plan, ctx, launch
        self.checkpoint, self.manifest = checkpoint, manifest
        self.t_start = t_start or time.time()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cfg.cluster.use_gpu else torch.device("cpu")
        self.tracker = None
        self.exp = storage.locate(ctx.experiment_dir)
        # Node-local staging, used only when the experiment lives on an object store.
        self.stage = staging.node_dir(paths.staging_root(cfg.storage.staging_dir), cfg.name, ctx.node_id)
        self.local_checkpoint: str | None = checkpoint if self.exp.is_local else None

    # ------------------------------------------------------------------ setup
    def _setup_tracking(self) -> None:
        from rayspeed.tracking.logger import MlflowLogger, NullLogger

        run_id = self.launch.get("mlflow_run_id")
        self.tracker = NullLogger()
        if self.ctx.is_rank0 and run_id:
            try:
                self.tracker = MlflowLogger(self.launch["tracking_uri"], run_id)
            except Exception as e:  # tracking must never kill training
                log.warning("MLflow unavailable (%s): training continues without tracking", e)

    def _build_data(self) -> None:
        from rayspeed.data import RankBatches, build_token_file, make_schedule, val_batches

        c = self.cfg
        cache = (c.data.cache_dir if c.data.cache_dir != AUTO
                 else paths.data_cache_dir(self.launch["storage_path"], c.storage.staging_dir, c.name))
        tf = build_token_file(c.data.source, c.data.path, c.data.tokenizer, cache)
        train, val = tf.split(c.data.val_fraction, c.model.seq_len)
        schedule = make_schedule(train, c.model.seq_len, c.train.global_batch_size, c.train.seed)
        g = self.groups
        self._train_split = train
        self.batches = RankBatches(
            train, c.model.seq_len, schedule, g.dp_rank, g.dp, c.parallel.micro_batch_size, c.parallel.grad_accum
        )
        # Each rank evaluates its share of eval_batches global batches (the same sequences for every
        # layout), in micro-batches of the training size.
        share = c.parallel.micro_batch_size * c.parallel.grad_accum
        self.val = val_batches(val, c.model.seq_len, share, c.train.eval_batches, g.dp_rank, g.dp)
        if self.ctx.is_rank0:
            log.info("data: %s; %d training sequences of %d tokens", tf, schedule.num_sequences, c.model.seq_len)

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
        self.batches = RankBatches(self._train_split, c.model.seq_len, schedule, g.dp_rank, g.dp,
                                   c.parallel.micro_batch_size, c.parallel.grad_accum, start_step=step)

    # ------------------------------------------------------------------ main
    def run(self) -> dict[str, Any]:
        from rayspeed.engine.build import build_engine
        from rayspeed.engine.deepspeed_config import deepspeed_config, rayspeed_clips
        from rayspeed.parallel.groups import ParallelGroups

        c, ctx = self.cfg, self.ctx
        phases = getattr(self, "phases", {})
        t = time.time()
        self._setup_tracking()
        _seed_all(c.train.seed)
        self.groups = ParallelGroups(c.parallel.dp, c.parallel.tp, c.parallel.pp)
        self._check_topology()
        self._build_data()
        phases["groups_and_data"] = time.time() - t
        t = time.time()
        self.ds_config = deepspeed_config(c, self.plan.best)
        tag = ckpt_resume.DS_TAG
        if self.checkpoint and not self.exp.is_local:
            self.local_checkpoint = self._stage_checkpoint(self.checkpoint)
        if self.checkpoint and ckpt_resume.needs_universal(self.manifest or {}, ckpt_resume.layout_of(c)):
            # Local storage: rank 0 converts the shared copy once. Object storage: every node converts its own
            # staged copy (the same input, so the same output), in parallel.
            converter = ctx.is_rank0 if self.exp.is_local else ctx.local_rank == 0
            err = None
            if converter:
                log.info("layout changed %s -> %s: converting %s to a universal checkpoint",
                         (self.manifest or {}).get("layout"), ckpt_resume.layout_of(c), manifest.name_of(self.checkpoint))
                try:
                    ckpt_resume.convert_to_universal(self.local_checkpoint)
                except Exception as e:
                    err = str(e)
            errs: list[Any] = [None] * ctx.world_size
            dist.all_gather_object(errs, err)
            if any(errs):
                raise RuntimeError(next(e for e in errs if e))
            tag = ckpt_resume.UNIVERSAL_TAG
            self.ds_config["checkpoint"] = {"load_universal": True}
        self.engine, self.pipelined = build_engine(c, self.ds_config, self.groups, self.device)
        self.clipper, self.grad_norm = None, None
        if rayspeed_clips(c):
            from rayspeed.engine.clip import GradClipper

            self.clipper = GradClipper(self.engine.module.parameters(), c.train.grad_clip, self.groups.tp_group)
        phases["engine"] = time.time() - t
        t = time.time()
        start_step, state = self._resume(tag)
        if self.checkpoint and not self.exp.is_local:
            dist.barrier()  # every rank on this node has loaded the staged copy
            if ctx.local_rank == 0:
                staging.clean(Path(self.local_checkpoint))
        phases["resume"] = time.time() - t
        t = time.time()
        if c.health.preflight:
            failed = self._preflight()
            if failed is not None:
                return failed
        phases["preflight"] = time.time() - t
        self._start_monitors()
        if ctx.is_rank0:
            log.info("startup: %s", ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
        if ctx.is_rank0:
            self._log_start(state)
        return self._train(start_step, state)

    def _preflight(self) -> dict[str, Any] | None:
        """Bandwidth and environment checks on the job's own workers before step 0. A failure ends the job
        at once (no restarts: the same cluster would fail the same way), with the reason in the summary."""
        from rayspeed.health.preflight import PreflightError, run_preflight

        try:
            report = run_preflight(self.cfg, self.groups, self.device)
        except PreflightError as e:
            result = {"status": "preflight_failed", "error": e.reason, "steps": 0, "world_size": self.ctx.world_size}
            if self.ctx.is_rank0:
                log.error("preflight failed: %s", e.reason)
                self.tracker.set_tags({"rayspeed.status": "preflight_failed", "rayspeed.preflight": e.reason[:4000]})
                self.tracker.close(timeout_s=60)
                self._write_result(result)
            return result
        if self.ctx.is_rank0:
            self.tracker.log_text(json.dumps(report.to_json(), indent=2, default=str), "health/preflight.json")
        return None

    def _start_monitors(self) -> None:
        from rayspeed.health.watchdog import Watchdog
        from rayspeed.monitoring.comm_timer import CommTimer
        from rayspeed.monitoring.system import SystemSampler

        c = self.cfg
        self.sampler = SystemSampler(self.ctx.rank, self.ctx.node_id, interval_s=5.0) if c.tracking.system_metrics else None
        self.comm = CommTimer(enabled=True)
        self.watchdog = Watchdog.from_config(c.health)
        self.charts = None
        if self.ctx.is_rank0 and self.launch.get("mlflow_run_id"):
            from rayspeed.tracking.charts import ChartPublisher

            self.charts = ChartPublisher(self.tracker, self.launch["tracking_uri"], self.launch["mlflow_run_id"])
        self.flops_per_token, self.peak_flops = _mfu_terms(c, self.plan)

    def _check_topology(self) -> None:
        """tp groups must sit on one node: Ray Train places a node's workers on consecutive ranks (verified
        here, not assumed)."""
        nodes: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(nodes, self.ctx.node_id)
        self._node_ids = nodes
        if self.cfg.parallel.tp <= 1 or not self.ctx.under_ray:
            return
        from rayspeed.parallel.groups import check_tp_within_nodes

        check_tp_within_nodes(self._node_ids, self.cfg.parallel.tp)

    def _log_start(self, state: dict[str, Any]) -> None:
        c, t = self.cfg, self.tracker
        params = flatten(to_dict(c))
        params.update({f"plan.{k}": v for k, v in flatten(_plain(self.plan.best)).items()})
        params.update(_versions())
        params["cluster.world_size_at_start"] = self.ctx.world_size
        try:
            from rayspeed.monitoring.system import lineage_params

            params.update(lineage_params(self._node_ids, use_gpu=c.cluster.use_gpu))
        except Exception as e:
            log.warning("lineage params unavailable: %s", e)
        t.log_params(params)
        t.set_tags({"rayspeed.job": c.name, "rayspeed.status": "running", "rayspeed.world_size": str(self.ctx.world_size)})
        t.log_text(to_yaml(c), "config/resolved.yaml")
        t.log_text(json.dumps(self.ds_config, indent=2, sort_keys=True), "config/deepspeed.json")
        t.log_text(json.dumps(_plain(self.plan.to_json()), indent=2, default=str), "plan/plan.json")
        t.log_text(self.plan.explain, "plan/explain.txt")
        t.log_metrics({"resilience/world_size": self.ctx.world_size, "resilience/restarts": state["restarts"]},
                      step=state["step"])
        log.info(
            "plan: dp=%s tp=%s pp=%s zero=%s micro=%s accum=%s ac=%s precision=%s global_batch=%s (world %d)",
            c.parallel.dp, c.parallel.tp, c.parallel.pp, c.parallel.zero_stage, c.parallel.micro_batch_size,
            c.parallel.grad_accum, c.parallel.activation_checkpointing, c.train.precision, c.train.global_batch_size,
            self.ctx.world_size,
        )

    # ------------------------------------------------------------------ checkpoints
    def _stage_checkpoint(self, chosen: str) -> str:
        """Object storage: local rank 0 of each node downloads and verifies `chosen`; the node's other ranks wait.
        Returns the staged local folder (the same path on every rank of a node)."""
        name = manifest.name_of(chosen)
        err = None
        local = self.stage / "load" / name
        if self.ctx.local_rank == 0:
            t0 = time.perf_counter()
            try:
                staging.fetch(self.exp, name, self.stage)
                log.info("staged %s from %s into %s in %.1f s", name, self.exp, local, time.perf_counter() - t0)
            except Exception as e:
                err = f"{type(e).__name__}: {e}"
        errs: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(errs, err)  # also the barrier the node's other ranks wait at
        if any(errs):
            raise RuntimeError(f"could not stage checkpoint {name}: {next(e for e in errs if e)}")
        return str(local)

    def _resume(self, tag: str) -> tuple[int, dict[str, Any]]:
        if self.checkpoint is None:
            return 0, {"step": 0, "restarts": 0}
        path = self.local_checkpoint
        _, client = self.engine.load_checkpoint(path, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
        if client is None:
            raise RuntimeError(f"DeepSpeed could not load {path} (tag {tag})")
        rng_file = Path(path) / f"rng_rank{self.ctx.rank}.pt"
        if rng_file.exists() and (self.manifest or {}).get("world_size") == self.ctx.world_size:
            _set_rng_state(torch.load(rng_file, weights_only=False))
        self._restore_data_position(client["data"])
        step = int(client["step"])
        state = {"step": step, "restarts": int(client.get("restarts", 0)) + 1, "resumed_from": self.checkpoint}
        if self.ctx.is_rank0:
            log.info("resumed from %s at step %d (restart %d, world %s -> %d)", manifest.name_of(self.checkpoint), step,
                     state["restarts"], (self.manifest or {}).get("world_size"), self.ctx.world_size)
        return step, state

    def _save_checkpoint(self, step: int, state: dict[str, Any]) -> float:
        """Commit protocol (rayspeed.checkpoint.manifest): shards, then one verified manifest. Returns the stall."""
        t0 = time.perf_counter()
        exp, name = self.exp, manifest.dir_name(step)
        if exp.is_local:
            d = exp.local / name
            if self.ctx.is_rank0:
                d.mkdir(parents=True, exist_ok=True)
        else:  # DeepSpeed writes local files: this rank's part goes to staging, then to the store
            d = staging.save_dir(self.stage, self.ctx.rank, step)
            if self.ctx.is_rank0 and exp.exists(name):
                # The same step saved again after a rollback or a resume from an older checkpoint: the old
                # objects (a manifest, a rejected.json) must not mix with the new ones.
                exp.delete(name)
        dist.barrier()
        client = {"step": step, "data": self.batches.state_dict(), "restarts": state["restarts"],
                  "mlflow_run_id": self.launch.get("mlflow_run_id")}
        self.engine.save_checkpoint(str(d), tag=ckpt_resume.DS_TAG, client_state=client, save_latest=False)
        torch.save(_rng_state(), d / f"rng_rank{self.ctx.rank}.pt")
        self._chaos_in_checkpoint(step)
        files = None
        if exp.is_local:
            dist.barrier()
        else:
            mine = staging.publish(exp, d)
            every: list[Any] = [None] * self.ctx.world_size
            dist.all_gather_object(every, mine)  # every rank's upload is done past this point
            files = {k: v for part in every for k, v in part.items()}
        if self.ctx.is_rank0:
            manifest.write_manifest(d if exp.is_local else str(exp.child(name)), step, self._manifest_meta(), files)
        dist.barrier()
        if self.ctx.under_ray:
            import ray.train
            from ray.train import Checkpoint, CheckpointUploadMode

            if exp.is_local:
                ck = Checkpoint.from_directory(str(d))
            else:  # a pointer into the store, on the filesystem Ray Train itself uses for the run
                sc = ray.train.get_context().get_storage()
                ck = Checkpoint(path=f"{sc.experiment_fs_path.rstrip('/')}/{name}", filesystem=sc.storage_filesystem)
            ray.train.report(
                {"step": step},
                checkpoint=ck,
                checkpoint_dir_name=name,
                checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
            )
        if self.ctx.is_rank0:
            for p in manifest.prune(str(exp), self.cfg.resilience.keep_checkpoints):
                log.info("deleted old checkpoint %s", manifest.name_of(p))
        return time.perf_counter() - t0

    def _manifest_meta(self) -> dict[str, Any]:
        import deepspeed

        c = self.cfg
        return {
            "job": c.name,
            "world_size": self.ctx.world_size,
            "layout": Layout.from_parallel(c.parallel).record(),  # + stage_layers when pipelined
            "global_batch_size": c.train.global_batch_size,
            "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__},
            "config_hash": _config_hash(c),
        }

    # ------------------------------------------------------------------ chaos drills
    def _chaos_marker(self, kind: str, rank: int, step: int) -> str:
        return f".chaos/{kind}_rank{rank}_step{step}"

    def _once(self, kind: str, spec: Any, step: int) -> bool:
        if spec is None or spec.rank != self.ctx.rank or spec.step != step:
            return False
        # In the experiment's storage: the restarted rank may run on another node.
        marker = self._chaos_marker(kind, spec.rank, spec.step)
        if self.exp.exists(marker):
            return False
        self.exp.write_bytes(marker, str(time.time()).encode())
        return True

    def _die(self, why: str) -> None:
        log.warning("chaos: %s", why)
        for h in logging.getLogger("rayspeed").handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def _chaos_step(self, step: int) -> None:
        ch = self.cfg.chaos
        if self._once("kill", ch.kill_rank_at_step, step):
            self._die(f"killing rank {self.ctx.rank} at step {step}")
        if self._once("hang", ch.hang_rank_at_step, step):
            log.warning("chaos: rank %d hangs at step %d", self.ctx.rank, step)
            while True:  # the others' collectives time out; Ray then restarts the group
                time.sleep(3600)

    def _chaos_in_checkpoint(self, step: int) -> None:
        if self._once("ckptkill", self.cfg.chaos.kill_rank_in_checkpoint, step):
            self._die(f"killing rank {self.ctx.rank} inside the checkpoint write of step {step}")

    # ------------------------------------------------------------------ training
    def _train_step(self, micro_batches: list) -> torch.Tensor:
        eng = self.engine
        if self.pipelined:
            return eng.train_batch(iter([(x.to(self.device), y.to(self.device)) for x, y in micro_batches])).float().mean()
        total = torch.zeros((), device=self.device)
        for x, y in micro_batches:
            loss = eng(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
            eng.backward(loss)
            if self.clipper is not None and eng.is_gradient_accumulation_boundary():
                self.grad_norm = self.clipper()  # gradients are all-reduced by now
            eng.step()
            total += loss.detach().float()
        return total / len(micro_batches)

    @torch.no_grad()
    def _evaluate(self) -> float:
        eng = self.engine
        eng.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        b = self.cfg.parallel.micro_batch_size
        n = 0
        for x, y in self.val:
            chunks = [(x[i : i + b].to(self.device), y[i : i + b].to(self.device)) for i in range(0, x.shape[0], b)]
            if self.pipelined:
                total += eng.eval_batch(iter(chunks)).detach().double().mean() * len(chunks)
            else:
                for cx, cy in chunks:
                    total += eng(cx, cy).detach().double()
            n += len(chunks)
        eng.train()
        return self._dp_mean(total / max(1, n))

    def _dp_mean(self, t: torch.Tensor) -> float:
        t = t.detach().clone().to(self.device, dtype=torch.float64)
        if self.groups.dp > 1:
            dist.all_reduce(t, group=self.groups.dp_group)
            t /= self.groups.dp
        return float(t.item())

    def _lr(self) -> float:
        return float(self.engine.optimizer.param_groups[0]["lr"]) if self.pipelined else float(self.engine.get_lr()[0])

    def _after_first_step(self, step: int, state: dict[str, Any]) -> None:
        now = time.time()
        from rayspeed.engine.state_bytes import model_state_bytes

        # Per-rank model-state bytes of the real engine (the optimizer state exists from the first step on).
        mine = model_state_bytes(self.engine)
        every: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(every, mine)
        self.model_state_bytes = {k: max(int(r[k]) for r in every) for k in mine}
        if not self.ctx.is_rank0:
            return
        self.tracker.log_metrics({f"memory/{k}_bytes": float(v) for k, v in self.model_state_bytes.items()}, step=step)
        log.info("first step done %.1f s after this attempt started", now - self.t_start)
        event = resilience.pending_event(self.ctx.experiment_dir) if state["restarts"] else None
        metrics: dict[str, float] = {"resilience/world_size": self.ctx.world_size, "resilience/restarts": state["restarts"]}
        if event is not None:
            recovery = now - event["time"]
            progress = resilience.read_progress(self.ctx.experiment_dir)
            lost = max(0, int(progress.get("step", state["step"])) - state["step"])
            metrics.update({"resilience/recovery_s": recovery, "resilience/lost_steps": lost})
            cause = event.get("kind", "restart")
            if event.get("causes"):
                cause += ": " + "; ".join(f"rank {r}: {c}" for r, c in event["causes"].items())
            self.tracker.set_tags({f"rayspeed.restart.{state['restarts']}": cause[:4000]})
            resilience.mark_recovered(self.ctx.experiment_dir, {"recovery_s": recovery, "lost_steps": lost, "step": step})
            log.info("recovered in %.1f s from %s (%d steps lost; this attempt started %.1f s after it)",
                     recovery, event.get("kind"), lost, self.t_start - event["time"])
            self.recovery_s = recovery
        self.tracker.log_metrics(metrics, step=step)

    def _log_window(self, done: int, loss_acc: torch.Tensor, n_acc: int, step_time: float) -> tuple[float, dict[str, float]]:
        """Metrics at a log step: the loss (the step's only host read), throughput, gradient-sync fraction,
        MFU on GPU, and every rank's system metrics (a collective: all ranks call this)."""
        c, ctx = self.cfg, self.ctx
        mean_loss = self._dp_mean(loss_acc / max(1, n_acc))
        tokens_per_s = c.train.global_batch_size * c.model.seq_len / step_time
        metrics = {
            "train/loss": mean_loss,
            "train/lr": self._lr(),
            "train/global_batch_size": c.train.global_batch_size,
            "perf/step_time_s": step_time,
            "perf/tokens_per_s": tokens_per_s,
            "resilience/world_size": ctx.world_size,
        }
        gn = self.grad_norm if self.clipper is not None else self.engine.get_global_grad_norm()
        if gn is not None:
            metrics["train/grad_norm"] = float(gn)
        metrics.update(self.comm.metrics())
        if self.peak_flops:
            metrics["perf/mfu"] = tokens_per_s * self.flops_per_token / (self.peak_flops * ctx.world_size)
        if self.sampler is not None:
            snap = self.sampler.snapshot()
            last = self.comm.last()
            if last:
                snap["comm_s"] = last["comm_s"]
            from rayspeed.monitoring.system import gather_system_metrics

            system = gather_system_metrics(snap, self.groups, node_id=ctx.node_id)
            if system:
                metrics.update(system)
        return mean_loss, metrics

    def _rollback(self, done: int, reason: str) -> bool:
        """Watchdog: restore the newest verified checkpoint in place and continue with the data after the
        bad window (replaying it would reproduce the same blow-up). False when there is nothing to restore."""
        chosen = None
        if self.ctx.is_rank0:
            found, _ = manifest.latest_verified(self.ctx.experiment_dir, deep=self.exp.is_local)
            chosen = str(found) if found else None
        chosen = _broadcast(chosen)
        if chosen is None:
            if self.ctx.is_rank0:
                log.warning("watchdog: %s, but no verified checkpoint to roll back to; continuing", reason)
            return False
        local = chosen if self.exp.is_local else self._stage_checkpoint(chosen)
        self.engine.load_checkpoint(local, tag=ckpt_resume.DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True)
        if not self.exp.is_local:
            dist.barrier()
            if self.ctx.local_rank == 0:
                staging.clean(Path(local))
        self.watchdog.reset()
        name = manifest.name_of(chosen)
        if self.ctx.is_rank0:
            log.warning("watchdog: %s -> rolled back to %s, skipping the data of steps %d..%d", reason,
                        name, (manifest.step_of(chosen) or 0) + 1, done)
            self.tracker.set_tags({f"rayspeed.watchdog.step{done}": f"rollback to {name}: {reason}"[:4000]})
        return True

    def _write_result(self, result: dict[str, Any]) -> None:
        self.exp.write_bytes("worker_result.json", json.dumps(result, default=str).encode())

    def _train(self, start_step: int, state: dict[str, Any]) -> dict[str, Any]:
        ctx = self.ctx
        self.engine.train()
        self.recovery_s = None
        progress = resilience.ProgressRecorder(ctx.experiment_dir) if ctx.is_rank0 else None
        try:
            return self._train_loop(start_step, state, progress)
        except BaseException:
            # A peer died or a collective timed out: the metrics of the steps done so far are still in the
            # logger's queue (it coalesces them); deliver them before Ray tears the group down.
            if ctx.is_rank0:
                self.tracker.flush(5.0)
            raise
        finally:
            if progress is not None:
                progress.close()

    def _train_loop(self, start_step: int, state: dict[str, Any], progress: Any) -> dict[str, Any]:
        c, ctx, t = self.cfg, self.ctx, self.tracker
        log_every = c.tracking.log_every_steps
        ck_every = c.resilience.checkpoint_every_steps
        loss_acc = torch.zeros((), device=self.device)
        n_acc = 0
        window_t0, window_steps = time.perf_counter(), 0
        first = True
        last_loss, val_loss = float("nan"), None
        stalls: list[float] = []
        checkpoints = 0
        perf_windows: list[tuple[int, int, float]] = []
        for step, micro in self.batches.iterate(start_step, c.train.max_steps - start_step):
            done = step + 1
            self._chaos_step(done)
            is_log = done % log_every == 0 or done == c.train.max_steps
            with self.comm.step(measure=is_log):
                loss = self._train_step(micro)
            loss_acc += loss.detach().float()
            n_acc += 1
            window_steps += 1
            if first:
                first = False
                self._after_first_step(done, state)
            if progress is not None:
                progress.update(done)
            if is_log:
                step_time = (time.perf_counter() - window_t0) / window_steps
                last_loss, metrics = self._log_window(done, loss_acc, n_acc, step_time)
                perf_windows.append((done - start_step, window_steps, step_time))  # planner feedback (this attempt)
                metrics.update(plan_metrics(self.plan.best, perf_windows, worst_rank_peak_memory_gib(self.device)))
                loss_acc.zero_()
                n_acc = 0
                t.log_metrics(metrics, step=done)
                if ctx.is_rank0:
                    log.info("step %d/%d loss %.4f lr %.2e %.3f s/step", done, c.train.max_steps, last_loss,
                             metrics["train/lr"], step_time)
                decision = self.watchdog.check(done, last_loss, metrics.get("train/grad_norm"))
                if not decision.ok:
                    self._rollback(done, decision.reason)
                window_t0, window_steps = time.perf_counter(), 0
            if (c.train.eval_every_steps and done % c.train.eval_every_steps == 0) or done == c.train.max_steps:
                val_loss = self._evaluate()
                t.log_metrics({"val/loss": val_loss}, step=done)
                if ctx.is_rank0:
                    log.info("step %d val loss %.4f", done, val_loss)
                window_t0 = time.perf_counter()
            if (ck_every and done % ck_every == 0) or done == c.train.max_steps:
                stall = self._save_checkpoint(done, state)
                stalls.append(stall)
                checkpoints += 1
                t.log_metrics({"perf/checkpoint_stall_s": stall}, step=done)
                n = c.tracking.charts_every_checkpoints
                if self.charts is not None and n and checkpoints % n == 0 and done != c.train.max_steps:
                    self.charts.publish()  # renders off the training thread
                window_t0 = time.perf_counter()  # checkpoint time is not step time
        self._finish_outputs(val_loss, last_loss)
        result = {
            "status": "finished",
            "steps": c.train.max_steps,
            "final_loss": last_loss,
            "val_loss": val_loss,
            "restarts": state["restarts"],
            "world_size": ctx.world_size,
            "global_batch_size": c.train.global_batch_size,
            "recovery_s": self.recovery_s,
            "checkpoint_stall_s": (sorted(stalls)[len(stalls) // 2] if stalls else None),
            "model_state_bytes": getattr(self, "model_state_bytes", None),
            "layout": {k: getattr(c.parallel, k) for k in ("dp", "tp", "pp", "zero_stage", "micro_batch_size", "grad_accum")},
            "registered_model_version": getattr(self, "model_version", None),
        }
        if self.sampler is not None:
            self.sampler.stop()
        if ctx.is_rank0:
            t.set_tags({"rayspeed.status": "finished"})
            t.close(timeout_s=120)
            self._write_result(result)
        return result

    def _finish_outputs(self, val_loss: float | None, last_loss: float) -> None:
        """The end of a run: loss landscape (collective), the model exported (collective) and registered,
        the five charts rendered from the run's history. None of it may fail the run."""
        from rayspeed.model.export import export_model
        from rayspeed.tracking.runs import registered_model_name

        c, ctx = self.cfg, self.ctx
        landscape = None
        if c.tracking.loss_landscape:
            try:
                from rayspeed.monitoring.landscape import loss_landscape

                batches = [(x[: c.parallel.micro_batch_size].to(self.device), y[: c.parallel.micro_batch_size].to(self.device))
                           for x, y in self.val[:2]]
                landscape = loss_landscape(self.engine, batches, None, seed=c.train.seed, steps=11,
                                           group=self.groups.dp_group if self.groups.dp > 1 else None)
            except Exception as e:
                log.warning("loss landscape failed: %s", e)
        # The export is logged to MLflow from a local folder: on object storage it goes to node-local staging.
        out_dir = str((self.exp.local if self.exp.is_local else self.stage) / "model")
        try:
            export_model(self.engine, c, out_dir, groups=self.groups)
        except Exception as e:
            log.warning("model export failed: %s", e)
            out_dir = None
        try:
            self._register(out_dir, val_loss, last_loss, landscape)
        finally:
            if out_dir and not self.exp.is_local and ctx.is_rank0:
                if getattr(self, "model_version", None) is None:  # not in MLflow: keep it beside the checkpoints
                    try:
                        self.exp.upload_dir(out_dir, "model")
                    except Exception as e:
                        log.warning("model export not uploaded to %s: %s", self.exp, e)
                staging.clean(Path(out_dir))  # staging is for transfers only

    def _register(self, out_dir: str | None, val_loss: float | None, last_loss: float, landscape: Any) -> None:
        from rayspeed.tracking.runs import registered_model_name

        c, ctx = self.cfg, self.ctx
        if not ctx.is_rank0 or not self.launch.get("mlflow_run_id"):
            return
        if out_dir:
            from rayspeed.tracking.registry import log_and_register

            self.tracker.flush(60)
            metrics = {"train/loss": last_loss}
            if val_loss is not None:
                metrics["val/loss"] = val_loss
            self.model_version = log_and_register(self.launch["tracking_uri"], self.launch["mlflow_run_id"], out_dir,
                                                  registered_model_name(c), metrics)
            if self.model_version:
                log.info("model registered as %s version %s", registered_model_name(c), self.model_version)
        if self.charts is not None:
            self.charts.publish(landscape=landscape, wait_s=180)


def _mfu_terms(cfg: JobConfig, plan: Any) -> tuple[float, float | None]:
    """(model FLOPs per token = 6N + 12 L h s, peak FLOP/s of one GPU) from the planner's tables; no MFU on CPU."""
    try:
        from rayspeed.planner.hardware import get as hardware
        from rayspeed.config.shape import ModelShape

        flops = ModelShape.from_config(cfg.model).flops_per_token
        if not cfg.cluster.use_gpu:
            return float(flops), None
        return float(flops), float(hardware(cfg.cluster.gpu, cfg.cluster.hardware).peak(cfg.train.precision))
    except Exception as e:
        log.warning("MFU unavailable: %s", e)
        return 0.0, None


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def _config_hash(cfg: JobConfig) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


def _versions() -> dict[str, str]:
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
