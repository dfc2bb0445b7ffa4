"""Scheduled retraining: one cycle (warm start, train, evaluate, register, promote on improvement) and the
cron line that runs it. See cycle.py (the cycle and its exit codes), lock.py, cron.py, cli.py."""

from rayspeed.retrain.cycle import (  # noqa: F401
    EXIT_BAD_INPUT,
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_REJECTED,
    EXIT_SKIPPED,
    CycleResult,
    decide,
    run_cycle,
)
