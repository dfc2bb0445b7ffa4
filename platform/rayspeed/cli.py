"""The `rayspeed` console script: plan, train, keys (and more subcommands as they land)."""

from __future__ import annotations

import sys

USAGE = """usage: rayspeed <command> [args]

commands:
  plan FILE [--set K=V]... [--json] [--top K] [--layouts FILE] [--explain] [--profile FILE]
           [--calibrate-from EXPERIMENT]
                      the layout to run, its memory and time, and why
  calibrate [--config FILE] [--workers N] --out FILE
                      measure this cluster for the planner (GEMMs, collectives, engine): a hardware profile
  train --config FILE [--set K=V]... [--launcher ray|local] [--dry-run]
                      same as python jobs/train.py
  keys                every job-file key with its type and meaning
  healthcheck [--workers N] [--json] [--config FILE]
                      inventory, topology and all-reduce/all-gather bandwidth of the Ray cluster
  doctor [LOGFILE|-|RAY_JOB_ID] [--env] [--json] [--config FILE]
                      name the causes and fixes in a job's log; --env lints the environment
  retrain --config FILE [--set K=V]... [--force] [--margin M] [--launcher ray|local] [--cold]
                      one retraining cycle: warm start, train, evaluate, register, promote on improvement
                      (exit 0 promoted, 3 skipped, 4 rejected, 1 failed, 2 bad input)
"""


def _keys() -> int:
    from rayspeed.config.load import describe_keys

    for key, typ, doc in describe_keys():
        print(f"{key:40s} {typ}\n    {doc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "plan":
        from rayspeed.planner.cli import main as plan_main

        return plan_main(rest)
    if cmd == "calibrate":
        import argparse

        from rayspeed.health.calibrate import calibrate_command, configure_calibrate_parser

        p = configure_calibrate_parser(argparse.ArgumentParser(prog="rayspeed calibrate"))
        try:
            args = p.parse_args(rest)
        except SystemExit as e:
            return 0 if e.code == 0 else 2
        return calibrate_command(args)
    if cmd == "train":
        from rayspeed.train.launch import main as train_main

        return train_main(rest)
    if cmd == "keys":
        return _keys()
    if cmd == "healthcheck":
        from rayspeed.health.healthcheck import main as healthcheck_main

        return healthcheck_main(rest)
    if cmd == "doctor":
        from rayspeed.health.doctor import main as doctor_main

        return doctor_main(rest)
    if cmd == "retrain":
        from rayspeed.retrain.cli import main as retrain_main

        return retrain_main(rest)
    print(f"rayspeed: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
