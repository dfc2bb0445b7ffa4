"""`rayspeed retrain`: one retraining cycle (what `make retrain` and the scheduled cron line run).

    rayspeed retrain --config FILE [--set K=V]... [--force] [--margin M] [--launcher ray|local] [--cold]
                     [--keep-cycles N] [--gate TASK/METRIC[:MIN_DELTA]]... [--json]

Exit codes: 0 done (a new champion), 3 skipped (data unchanged, or another cycle holds the lock),
4 rejected (registered, not promoted), 1 failed, 2 bad input. The last stdout line is the cycle's JSON.
"""

from __future__ import annotations

import argparse
import json
import sys


def retrain_command(args: argparse.Namespace) -> int:
    from rayspeed.logs import setup
    from rayspeed.retrain.cycle import run_cycle

    setup()
    result = run_cycle(args.config, args.overrides, force=args.force, margin=args.margin, launcher=args.launcher,
                       cold=args.cold, keep_cycles=args.keep_cycles, reeval_max_gflop=args.reeval_max_gflop,
                       gates=args.gates)
    print(f"retrain: {result.outcome} (exit {result.exit_code}): {result.reason}", file=sys.stderr, flush=True)
    print(json.dumps(result.to_json(), default=str), flush=True)
    return result.exit_code
