"""Throughput figures leave out the step the gradient-sync timer measures (it synchronises the device around every
collective): StepWindow times only unmeasured steps, and the metrics callback samples one log step per window (every
tenth log step when every window is one step), reporting no throughput for a window with nothing else."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from rayspeed.config.load import parse
from rayspeed.tracking.logger import NullLogger
from rayspeed.train.events import Callbacks, TrainState
from rayspeed.train.metrics_callback import COMM_SAMPLE_EVERY, MetricsCallback, StepWindow

LOSS = torch.tensor(2.0)


def test_measured_steps_and_pauses_are_not_step_time():
    w = StepWindow(torch.device("cpu"))
    for measured, seconds in ((False, 0.02), (False, 0.02), (True, 0.6), (False, 0.02)):
        time.sleep(seconds)
        w.add(LOSS, measured=measured)
        if not measured:
            time.sleep(0.3)  # validation or a checkpoint after this step...
            w.pause_excluded()  # ...is not the next step's time
    assert w.steps == 4 and w.measured == 1
    assert w.step_time() == pytest.approx(0.02, abs=0.05)  # all four steps: ~0.17 s
    w.restart()
    time.sleep(0.05)
    w.add(LOSS, measured=True)
    assert w.step_time() is None  # nothing but the measured step


def _reporter(log_every: int) -> MetricsCallback:
    cfg = parse({"name": "w", "tracking": {"log_every_steps": log_every}, "train": {"max_steps": 100}})
    ctx = SimpleNamespace(is_rank0=False, rank=0, world_size=1, node_id="n", experiment_dir="/nonexistent")
    plan = SimpleNamespace(best={"step_time_s": 0.02, "memory_gib_per_gpu": 1.0})
    r = MetricsCallback(cfg, plan, ctx, SimpleNamespace(dp=1), torch.device("cpu"), Callbacks(), NullLogger(),
                        lambda: 1e-3, lambda: None)
    r.first_step_done = True  # the first-step report is a collective over a real engine: not what is tested here
    return r


def _run(r: MetricsCallback, steps: range, seconds=lambda step, measured: 0.0) -> tuple[dict[int, dict], list[int]]:
    logged, measured = {}, []
    state = TrainState(max_steps=r.cfg.train.max_steps)
    for step in steps:
        with r.timed_step(step):
            if r.measuring:
                measured.append(step)
            time.sleep(seconds(step, r.measuring))
        r.step_timed(LOSS)
        state.step = step
        if r.should_log(step):
            logged[step] = r.log_window(state)
    return logged, measured


def test_one_step_per_window_is_measured_and_left_out_of_throughput():
    r = _reporter(log_every=5)
    logged, measured = _run(r, range(1, 11), lambda step, m: 0.5 if m else 0.02)
    assert measured == [5, 10]
    for step in (5, 10):
        assert logged[step]["perf/step_time_s"] == pytest.approx(0.02, abs=0.05)  # with the measured step: ~0.12
        assert logged[step]["perf/tokens_per_s"] == pytest.approx(
            r.cfg.train.global_batch_size * r.cfg.model.seq_len / logged[step]["perf/step_time_s"])


def test_single_step_windows_sample_every_tenth_log_step():
    r = _reporter(log_every=1)
    logged, measured = _run(r, range(1, 2 * COMM_SAMPLE_EVERY + 1))
    sampled = [s for s, m in logged.items() if "perf/step_time_s" not in m]
    assert measured == sampled == [COMM_SAMPLE_EVERY, 2 * COMM_SAMPLE_EVERY]  # no throughput for those steps
    assert all("perf/tokens_per_s" in m for s, m in logged.items() if s not in sampled)
