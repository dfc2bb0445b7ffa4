"""The worker loop: the same function under Ray Train (one per worker) and in-process (--launcher local).

At every (re)start the worker re-plans for the world size it actually got, builds the model and the
DeepSpeed engine, resumes from the newest verified checkpoint, and trains. Rank 0 alone talks to MLflow.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rayspeed.checkpoint import store
from rayspeed.config.load import flatten, parse, to_dict, to_yaml
from rayspeed.config.schema import JobConfig
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


def run_worker(config: dict[str, Any], ctx: WorkerContext) -> dict[str, Any]:
    _setup_logging(ctx.rank)
    from rayspeed.planner import resolve

    # The user's job (with its "auto"s) is re-planned here, for the world this attempt actually got.
    job = parse(config["job"])
    cfg, plan = resolve(job, world_size=ctx.world_size)
    return Trainer(cfg, plan, ctx, config).run()


class Trainer:
    def __init__(self, cfg: JobConfig, plan: Any, ctx: WorkerContext, launch: dict[str, Any]):
        self.cfg, self.plan, self.ctx, self.launch = cfg, plan, ctx, launch
        self.t_launch = float(launch.get("launched_at", time.time()))
        self.device = torch.device("cpu")
        self.tracker = None

    # ------------------------------------------------------------------ setup
    def _setup_distributed(self) -> None:
        import deepspeed

        backend = "nccl" if self.cfg.cluster.use_gpu else "gloo"
        if self.cfg.cluster.use_gpu:
            self.device = torch.device("cuda", torch.cuda.current_device())
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)

    def _setup_tracking(self) -> None:
        from rayspeed.tracking.logger import MlflowLogger, NullLogger

        run_id = self.launch.get("mlflow_run_id")
        if self.ctx.is_rank0 and run_id:
            try:
                self.tracker = MlflowLogger(self.launch["tracking_uri"], run_id)
            except Exception as e:  # tracking must never kill training
                log.warning("MLflow unavailable (%s): training continues without tracking", e)
                self.tracker = NullLogger()
        else:
            self.tracker = NullLogger()

    def _build_data(self):
        from rayspeed.data import RankBatches, build_token_file, make_schedule, val_batches

        c = self.cfg
        cache = c.data.cache_dir if c.data.cache_dir != "auto" else str(Path(self.launch["storage_path"]) / ".cache" / "data")
        tf = build_token_file(c.data.source, c.data.path, c.data.tokenizer, cache)
        train, val = tf.split(c.data.val_fraction, c.model.seq_len)
        schedule = make_schedule(train, c.model.seq_len, c.train.global_batch_size, c.train.seed)
        g = self.groups
        self.batches = RankBatches(
            train, c.model.seq_len, schedule, g.dp_rank, g.dp, c.parallel.micro_batch_size, c.parallel.grad_accum
        )
        # Each rank evaluates its share of eval_batches global batches (same sequences for every layout),
        # in micro-batches of the training size.
        share = c.parallel.micro_batch_size * c.parallel.grad_accum
        self.val = val_batches(val, c.model.seq_len, share, c.train.eval_batches, g.dp_rank, g.dp)
        self.token_file = tf
        if self.ctx.is_rank0:
            log.info("data: %s; %d training sequences of %d tokens", tf, schedule.num_sequences, c.model.seq_len)

    # ------------------------------------------------------------------ main
    def run(self) -> dict[str, Any]:
        from rayspeed.engine.build import build_engine
        from rayspeed.engine.deepspeed_config import deepspeed_config

        c, ctx = self.cfg, self.ctx
        self._setup_distributed()
        self._setup_tracking()
        _seed_all(c.train.seed)
        from rayspeed.parallel.groups import ParallelGroups

        self.groups = ParallelGroups(c.parallel.dp, c.parallel.tp, c.parallel.pp)
        self._build_data()
        self.ds_config = deepspeed_config(c, self.plan.best)
        self.engine, self.pipelined = build_engine(c, self.ds_config, self.groups, self.device)
        start_step, state = self._resume()
        if ctx.is_rank0:
            self._log_start(state)
        result = self._train(start_step, state)
        return result

    def _log_start(self, state: dict[str, Any]) -> None:
        c = self.cfg
        t = self.tracker
        params = flatten(to_dict(c))
        params.update({f"plan.{k}": v for k, v in flatten(_plain(self.plan.best)).items()})
        params.update(_versions())
        t.log_params(params)
        t.set_tags({"rayspeed.job": c.name, "rayspeed.status": "running", "rayspeed.world_size": str(self.ctx.world_size)})
        t.log_text(to_yaml(c), "config/resolved.yaml")
        t.log_text(json.dumps(self.ds_config, indent=2, sort_keys=True), "config/deepspeed.json")
        t.log_text(json.dumps(_plain(self.plan.to_json()), indent=2, default=str), "plan/plan.json")
        t.log_text(self.plan.explain, "plan/explain.txt")
        restarts = state.get("restarts", 0)
        t.log_metrics({"resilience/world_size": self.ctx.world_size, "resilience/restarts": restarts}, step=state.get("step", 0))
        log.info(
            "plan: dp=%s tp=%s pp=%s zero=%s micro=%s accum=%s ac=%s precision=%s (world %d)",
            c.parallel.dp, c.parallel.tp, c.parallel.pp, c.parallel.zero_stage, c.parallel.micro_batch_size,
            c.parallel.grad_accum, c.parallel.activation_checkpointing, c.train.precision, self.ctx.world_size,
        )

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_root(self) -> Path:
        return Path(self.ctx.experiment_dir)

    def _resume(self) -> tuple[int, dict[str, Any]]:
        """Newest manifest-verified checkpoint: Ray's latest if it verifies, else a scan of the run folder."""
        chosen = None
        if self.ctx.is_rank0:
            candidates = []
            if self.ctx.under_ray:
                import ray.train

                ck = ray.train.get_checkpoint()
                if ck is not None:
                    candidates.append(Path(ck.path))
            for p in candidates:
                v = store.verify(p)
                if v.ok:
                    chosen = str(p)
                    break
                log.warning("checkpoint %s rejected: %s", p, v.reason)
            if chosen is None:
                found, skipped = store.latest_verified(self._checkpoint_root())
                for s in skipped:
                    log.warning("checkpoint rejected: %s", s)
                chosen = str(found) if found else None
        chosen = _broadcast(chosen)
        if chosen is None:
            return 0, {"step": 0, "restarts": 0}
        manifest = store.read_manifest(chosen) or {}
        load_path, tag = chosen, "ds"
        _, client = self.engine.load_checkpoint(load_path, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
        client = client or {}
        rng_file = Path(chosen) / f"rng_rank{self.ctx.rank}.pt"
        if rng_file.exists() and manifest.get("world_size") == self.ctx.world_size:
            _set_rng_state(torch.load(rng_file, weights_only=False))
        self.batches.load_state_dict(client["data"])
        step = int(client["step"])
        state = {"step": step, "restarts": int(client.get("restarts", 0)) + 1, "resumed_from": chosen}
        if self.ctx.is_rank0:
            log.info("resumed from %s at step %d (restart %d)", Path(chosen).name, step, state["restarts"])
        return step, state

    def _save_checkpoint(self, step: int, state: dict[str, Any]) -> float:
        """Commit protocol (see rayspeed.checkpoint.store). Returns the stall in seconds."""
        t0 = time.perf_counter()
        root = self._checkpoint_root()
        d = root / store.dir_name(step)
        if self.ctx.is_rank0:
            d.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        client = {"step": step, "data": self.batches.state_dict(), "restarts": state.get("restarts", 0),
                  "mlflow_run_id": self.launch.get("mlflow_run_id")}
        self.engine.save_checkpoint(str(d), tag="ds", client_state=client, save_latest=False)
        torch.save(_rng_state(), d / f"rng_rank{self.ctx.rank}.pt")
        dist.barrier()
        if self.ctx.is_rank0:
            store.write_manifest(d, step, self._manifest_meta(step))
        dist.barrier()
        if self.ctx.under_ray:
            import ray.train
            from ray.train import Checkpoint, CheckpointUploadMode

            ray.train.report(
                {"step": step},
                checkpoint=Checkpoint.from_directory(str(d)),
                checkpoint_dir_name=d.name,
                checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
            )
        if self.ctx.is_rank0:
            for p in store.prune(root, self.cfg.resilience.keep_checkpoints):
                log.info("deleted old checkpoint %s", p.name)
        return time.perf_counter() - t0

    def _manifest_meta(self, step: int) -> dict[str, Any]:
        import deepspeed

        c = self.cfg
        return {
            "job": c.name,
            "world_size": self.ctx.world_size,
            "layout": {k: getattr(c.parallel, k) for k in ("dp", "tp", "pp", "zero_stage", "micro_batch_size", "grad_accum")},
            "global_batch_size": c.train.global_batch_size,
            "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__},
            "config_hash": _config_hash(c),
        }

    # ------------------------------------------------------------------ training
    def _chaos(self, step: int) -> None:
        k = self.cfg.chaos.kill_rank_at_step
        if k is None or k.rank != self.ctx.rank or k.step != step:
            return
        marker = Path(self.launch["storage_path"]) / self.cfg.name / ".chaos" / f"killed_rank{k.rank}_step{k.step}"
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(time.time()))
        log.warning("chaos: killing rank %d at step %d", k.rank, step)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)

    def _train_step(self, micro_batches: list) -> torch.Tensor:
        eng = self.engine
        if self.pipelined:
            return eng.train_batch(iter([(x.to(self.device), y.to(self.device)) for x, y in micro_batches]))
        total = torch.zeros((), device=self.device)
        for x, y in micro_batches:
            loss = eng(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
            eng.backward(loss)
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
                total += eng.eval_batch(iter(chunks)).detach().double() * len(chunks)
            else:
                for cx, cy in chunks:
                    total += eng(cx, cy).detach().double()
            n += len(chunks)
        eng.train()
        value = total / max(1, n)
        return self._dp_mean(value)

    def _dp_mean(self, t: torch.Tensor) -> float:
        t = t.detach().clone().to(self.device, dtype=torch.float64)
        if self.groups.dp > 1:
            dist.all_reduce(t, group=self.groups.dp_group)
            t /= self.groups.dp
        return float(t.item())

    def _train(self, start_step: int, state: dict[str, Any]) -> dict[str, Any]:
        c, ctx, t = self.cfg, self.ctx, self.tracker
        log_every = c.tracking.log_every_steps
        ck_every = c.resilience.checkpoint_every_steps
        tokens_per_step = c.train.global_batch_size * c.model.seq_len
        self.engine.train()
        loss_acc = torch.zeros((), device=self.device)
        n_acc = 0
        window_t0 = time.perf_counter()
        window_steps = 0
        first_step_done = None
        last_loss = float("nan")
        val_loss = None
        stalls = []
        for step, micro in self.batches.iterate(start_step, c.train.max_steps - start_step):
            self._chaos(step + 1)
            loss = self._train_step(micro)
            loss_acc += loss.detach().float()
            n_acc += 1
            window_steps += 1
            done = step + 1
            if first_step_done is None:
                first_step_done = time.time()
                if ctx.is_rank0:
                    log.info("first step done %.1f s after launch", first_step_done - self.t_launch)
            if done % log_every == 0 or done == c.train.max_steps:
                # The only host sync of the step: the loss is read at log steps.
                mean_loss = self._dp_mean(loss_acc / n_acc)
                loss_acc.zero_()
                n_acc = 0
                elapsed = time.perf_counter() - window_t0
                step_time = elapsed / window_steps
                window_t0, window_steps = time.perf_counter(), 0
                last_loss = mean_loss
                metrics = {
                    "train/loss": mean_loss,
                    "train/lr": float(self.engine.get_lr()[0]) if not self.pipelined else float(self.engine.optimizer.param_groups[0]["lr"]),
                    "train/global_batch_size": c.train.global_batch_size,
                    "perf/step_time_s": step_time,
                    "perf/tokens_per_s": tokens_per_step / step_time,
                    "resilience/world_size": ctx.world_size,
                }
                gn = self.engine.get_global_grad_norm()
                if gn is not None:
                    metrics["train/grad_norm"] = float(gn)
                t.log_metrics(metrics, step=done)
                if ctx.is_rank0:
                    log.info("step %d/%d loss %.4f lr %.2e %.3f s/step", done, c.train.max_steps, mean_loss, metrics["train/lr"], step_time)
            if (c.train.eval_every_steps and done % c.train.eval_every_steps == 0) or done == c.train.max_steps:
                val_loss = self._evaluate()
                t.log_metrics({"val/loss": val_loss}, step=done)
                if ctx.is_rank0:
                    log.info("step %d val loss %.4f", done, val_loss)
            if (ck_every and done % ck_every == 0) or done == c.train.max_steps:
                stall = self._save_checkpoint(done, state)
                stalls.append(stall)
                t.log_metrics({"perf/checkpoint_stall_s": stall}, step=done)
                window_t0 = time.perf_counter()  # checkpoint time is not step time
        result = {
            "status": "finished",
            "steps": c.train.max_steps,
            "final_loss": last_loss,
            "val_loss": val_loss,
            "restarts": state.get("restarts", 0),
            "world_size": ctx.world_size,
        }
        if ctx.is_rank0:
            t.set_tags({"rayspeed.status": "finished"})
            t.close(timeout_s=120)
            Path(ctx.experiment_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(ctx.experiment_dir) / "worker_result.json", "w") as fh:
                json.dump(result, fh)
        return result


def _broadcast(obj: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
