"""Where a start's seconds go (rayspeed.train.timeline): each phase is the time since the previous mark, the
launcher's phases and the worker's add up to the command's total, a recovery counts from the failure."""

from __future__ import annotations

import time

import pytest

from rayspeed.train.context import WorkerContext
from rayspeed.train.payload import LaunchPayload
from rayspeed.train.recovery import RecoveryCallback
from rayspeed.train.timeline import Timeline, start_line


def test_each_phase_is_the_time_since_the_previous_mark():
    clock = Timeline(100.0)
    clock.mark("config", 100.5)
    clock.mark("plan", 101.75)
    clock.mark("config", 102.0)  # a phase marked again adds up
    assert clock.phases == {"config": 0.75, "plan": 1.25}
    assert Timeline.since_process_start().started <= time.time()
    assert start_line({"config": 0.75, "plan": 1.25}, 2.0) == (
        "start: 2.0 s from the command to the first step (config 0.8 s, plan 1.2 s)")


def _callback(tmp_path, payload):
    ctx = WorkerContext(1, 2, 1, 0, "node", str(tmp_path), under_ray=False)  # rank 1: no progress thread
    return RecoveryCallback(ctx, None, attempt_started=110.0, phases={"imports": 1.0, "engine": 2.0},
                            payload=payload)


def test_a_start_adds_up_from_the_command_and_a_recovery_from_the_failure(tmp_path):
    payload = LaunchPayload(job={}, tracking_uri="", storage_path="", experiment_dir=str(tmp_path),
                            launched_at=100.0, start_phases={"interpreter": 1.0, "plan": 2.0}, handed_at=104.0)
    start = _callback(tmp_path, payload).timeline(now=120.0, failed_at=None)
    assert start == {"startup/interpreter_s": 1.0, "startup/plan_s": 2.0, "startup/worker_start_s": 6.0,
                     "startup/imports_s": 1.0, "startup/engine_s": 2.0, "startup/first_step_s": 7.0,
                     "startup/total_s": 20.0}
    recovered = _callback(tmp_path, payload).timeline(now=120.0, failed_at=107.5)
    assert recovered == {"recovery/restart_s": 2.5, "recovery/imports_s": 1.0, "recovery/engine_s": 2.0,
                         "recovery/first_step_s": 7.0, "recovery/total_s": 12.5}
    assert sum(v for k, v in recovered.items() if k != "recovery/total_s") == pytest.approx(12.5)
