"""The run's numbers: step time, throughput, the gradient-sync share, MFU, the plan's feedback and every rank's
system metrics at each log step (fired as the `log` event), and the real engine's model-state bytes after the
first step. Every rank computes them (the loss mean and the system-metric gather are collectives); the tracker
writes on rank 0 only.

    metrics = MetricsCallback(cfg, plan, ctx, groups, device, events, tracker, lr, grad_norm)
    with metrics.timed_step(step):          # the comm timer measures sampled log steps, left out of throughput
        loss = train_step(...)
    metrics.step_timed(loss)                # the step's time ends here
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import torch

from rayspeed.config.schema import JobConfig
from rayspeed.health.calibration import worst_rank_peak_memory_gib
from rayspeed.logs import log_rank
from rayspeed.parallel.objects import gather_objects
from rayspeed.planner.feedback import memory_check, plan_metrics
from rayspeed.train.evaluation import dp_mean
from rayspeed.train.events import Callback, TrainState

log = logging.getLogger("rayspeed.worker")

# The gradient-sync timer measures one step per log window; when every window is a single step
# (tracking.log_every_steps 1), one log step in this many.
COMM_SAMPLE_EVERY = 10


def mfu_terms(cfg: JobConfig, shape: Any = None) -> tuple[float, Optional[float]]:
    """(model FLOPs per token: ModelShape.flops_per_token, PaLM's 6 N non-embedding + 12 L h s, the one definition,
    an adapter job's frozen weights without their weight gradient (config.adapter.flops_per_token); peak FLOP/s of
    one GPU from the planner's tables); no MFU on CPU."""
    try:
        from rayspeed.config import adapter
        from rayspeed.config.shape import ModelShape
        from rayspeed.planner.hardware import get as hardware

        flops = adapter.flops_per_token(shape or ModelShape.from_config(cfg.model), cfg.model.adapter)
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


class MetricsCallback(Callback):
    def __init__(self, cfg: JobConfig, plan: Any, ctx: Any, groups: Any, device: torch.device, events: Any,
                 tracker: Any, lr: Callable[[], float], grad_norm: Callable[[], Optional[float]], engine: Any = None,
                 shape: Any = None):
        from rayspeed.monitoring.comm_timer import CommTimer

        self.cfg, self.plan, self.ctx, self.groups, self.device = cfg, plan, ctx, groups, device
        self.events, self.tracker, self.lr, self.grad_norm, self.engine = events, tracker, lr, grad_norm, engine
        self.log_every = cfg.tracking.log_every_steps
        self.comm = CommTimer(enabled=True)
        self.window = StepWindow(device)
        self.measuring = False
        self.sampler: Any = None
        self.flops_per_token, self.peak_flops = mfu_terms(cfg, shape)
        self.first_step_done = False
        # (last step of the window counted from this attempt's start, steps in it, seconds per step): the planner's
        # feedback compares its prediction with the steady-state windows (rayspeed.planner.feedback).
        self.perf_windows: list[tuple[int, int, float]] = []
        # Others' metrics for the same log step (collectives: every rank calls them), e.g. the experts' load.
        self.sources: list[Callable[[TrainState], dict[str, float]]] = []

    def should_log(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.cfg.train.max_steps

    def timed_step(self, step: int) -> Any:
        self.measuring = self.sample_comm(step)
        return self.comm.step(measure=self.measuring)

    def step_timed(self, loss: torch.Tensor) -> None:
        self.window.add(loss, measured=self.measuring)
        self.measuring = False

    def sample_comm(self, step: int) -> bool:
        """Whether the gradient-sync timer measures this step: the log step of a window that has other steps to
        time (the measured one is left out of the window's throughput); when the window is this step alone, only
        every COMM_SAMPLE_EVERY-th log step (that window then reports no throughput)."""
        if not self.should_log(step):
            return False
        return self.window.steps >= 1 or step % (COMM_SAMPLE_EVERY * self.log_every) == 0

    # ------------------------------------------------------------------ events
    def on_start(self, state: TrainState) -> None:
        if self.cfg.tracking.system_metrics:
            from rayspeed.monitoring.system import SystemSampler

            self.sampler = SystemSampler(self.ctx.rank, self.ctx.node_id, interval_s=5.0)

    def on_step_end(self, state: TrainState) -> None:
        if not self.first_step_done:
            self.first_step(state)
        if self.should_log(state.step):
            self.log_window(state)

    def on_validation(self, state: TrainState, val_loss: float) -> None:
        self.window.pause_excluded()

    def on_checkpoint_saved(self, state: TrainState, stall_s: float) -> None:
        self.window.pause_excluded()

    def on_end(self, state: TrainState) -> None:
        self._stop()

    def on_failure(self, state: TrainState, error: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler = None

    # ------------------------------------------------------------------ what is measured
    def first_step(self, state: TrainState) -> None:
        """Once per attempt (a collective): the model-state bytes of the real engine (its optimizer state exists
        from the first step on)."""
        from rayspeed.engine.state_bytes import model_state_bytes

        self.first_step_done = True
        every = gather_objects(model_state_bytes(self.engine))
        state.model_state_bytes = {k: max(int(r[k]) for r in every) for k in every[0]}
        self.tracker.log_metrics({f"memory/{k}_bytes": float(v) for k, v in state.model_state_bytes.items()},
                                 step=state.step)
        peak = worst_rank_peak_memory_gib(self.device)  # GPUs only (a collective there)
        if peak is not None:
            over, line = memory_check(self.plan.best, peak)
            log_rank(log, "%s", line, level=logging.WARNING if over else logging.INFO)

    def log_window(self, state: TrainState) -> dict[str, float]:
        """Metrics at a log step: the loss (the step's only host read), throughput, gradient-sync fraction, MFU on
        GPU, and every rank's system metrics (a collective: all ranks call this). Restarts the window. Throughput
        (step time, tokens/s, MFU) comes from the window's steps the gradient-sync timer did not measure; a window
        without one reports none."""
        c, ctx, w, step = self.cfg, self.ctx, self.window, state.step
        step_time = w.step_time()
        mean_loss = dp_mean(w.loss / max(1, w.steps), self.groups, self.device)
        lr = self.lr()
        metrics = {
            "train/loss": mean_loss,
            "train/lr": lr,
            "train/global_batch_size": c.train.global_batch_size,
            "resilience/world_size": ctx.world_size,
        }
        if step_time:
            rows = 2 if c.train.objective == "dpo" else 1  # a preference pair is two sequences through the model
            tokens_per_s = rows * c.train.global_batch_size * c.model.seq_len / step_time
            metrics.update({"perf/step_time_s": step_time, "perf/tokens_per_s": tokens_per_s})
            if self.peak_flops:
                metrics["perf/mfu"] = tokens_per_s * self.flops_per_token / (self.peak_flops * ctx.world_size)
        grad_norm = self.grad_norm()
        if grad_norm is not None:
            metrics["train/grad_norm"] = float(grad_norm)
        metrics.update(self.comm.metrics())
        for source in self.sources:
            metrics.update(source(state))
        if step_time:
            self.perf_windows.append((step - state.start_step, w.steps, step_time))
        metrics.update(plan_metrics(self.plan.best, self.perf_windows, worst_rank_peak_memory_gib(self.device)))
        if self.sampler is not None:
            from rayspeed.monitoring.system_gather import gather_system_metrics

            snap = self.sampler.snapshot()
            last = self.comm.last()
            if last:
                snap["comm_s"] = last["comm_s"]
            system = gather_system_metrics(snap, self.groups, node_id=ctx.node_id)
            if system:
                metrics.update(system)
        state.last_loss = mean_loss
        prefs = (f" reward accuracy {metrics['rewards/accuracies']:.3f} margin {metrics['rewards/margins']:.3f}"
                 if "rewards/accuracies" in metrics else "")  # a DPO job's progress beside its loss
        log_rank(log, "step %d/%d loss %.4f lr %.2e %s s/step%s", step, c.train.max_steps, mean_loss, lr,
                 f"{step_time:.3f}" if step_time else "-", prefs)
        w.restart()
        self.events.log(state, metrics)
        return metrics
