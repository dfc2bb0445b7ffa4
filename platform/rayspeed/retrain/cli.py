"""`rayspeed retrain`: one retraining cycle (what `make retrain` and the scheduled cron line run).

    rayspeed retrain --config FILE [--set K=V]... [--force] [--margin M] [--launcher ray|local] [--cold]
                     [--keep-cycles N] [--json]

Exit codes: 0 done (a new champion), 3 skipped (data unchanged, or another cycle holds the lock),
4 rejected (registered, not promoted), 1 failed, 2 bad input. The last stdout line is the cycle's JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="rayspeed retrain", description=(
        "One retraining cycle: warm-start from the champion, train on the current data, evaluate, register, "
        "promote on improvement. Exit 0 promoted, 3 skipped, 4 rejected, 1 failed, 2 bad input."))
    ap.add_argument("--config", required=True, help="job YAML file")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key (as in train)")
    ap.add_argument("--force", action="store_true", help="retrain even if the data has not changed")
    ap.add_argument("--margin", type=float, default=0.0,
                    help="relative val/loss improvement required to promote: new < champion * (1 - margin) (default 0)")
    ap.add_argument("--launcher", choices=("ray", "local"), default="ray",
                    help="ray (default): the cluster in RAY_ADDRESS, else an embedded local Ray; local: in-process")
    ap.add_argument("--cold", action="store_true", help="train from scratch even when a champion exists")
    ap.add_argument("--keep-cycles", type=int, default=3,
                    help="cycle folders (checkpoints) kept under storage; older ones are deleted (0: keep all)")
    ap.add_argument("--reeval-max-gflop", type=float, default=2000.0,
                    help="re-evaluate the champion on changed data on the CPU only below this cost (GFLOP)")
    return ap.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    from rayspeed.logs import setup

    setup()
    try:
        args = parse_args(argv)
    except SystemExit as e:  # argparse: usage error -> 2, --help -> 0
        return int(e.code or 0)
    from rayspeed.retrain.cycle import run_cycle

    result = run_cycle(args.config, args.set, force=args.force, margin=args.margin, launcher=args.launcher,
                       cold=args.cold, keep_cycles=args.keep_cycles, reeval_max_gflop=args.reeval_max_gflop)
    print(f"retrain: {result.outcome} (exit {result.exit_code}): {result.reason}", file=sys.stderr, flush=True)
    print(json.dumps(result.to_json(), default=str), flush=True)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
