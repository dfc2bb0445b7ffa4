"""`rayspeed plan`: the plan, its JSON, its explanation, or one verdict per given layout; `--calibrate-from` first
fits a hardware profile to an experiment's finished runs (reading MLflow, which is why this command lives above
the planner package: the planner itself never imports it)."""

from __future__ import annotations

import argparse
import json
import sys

from rayspeed.errors import EXIT_BAD_INPUT, EXIT_OK, ConfigError


def plan_command(args: argparse.Namespace) -> int:
    from rayspeed.config.load import load
    from rayspeed.planner import plan_job
    from rayspeed.planner.report import evaluate_file, fit_summary, summary

    try:
        cfg = load(args.file, args.overrides)
        if args.world_size is not None and args.world_size < 1:
            raise ConfigError(f"--world-size: must be >= 1, got {args.world_size}")
        profile = args.profile
        if args.calibrate_from:
            from rayspeed.health.calibfit_runs import calibrate_from

            fitted, profile = calibrate_from(cfg, args.calibrate_from, args.profile)
            print(fit_summary(fitted, profile), file=sys.stderr)
        if args.layouts:
            for line in evaluate_file(cfg, args.layouts, args.world_size, profile):
                print(line)
            return EXIT_OK
        res = plan_job(cfg, world_size=args.world_size, top_k=max(0, args.top), profile=profile)
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        if args.json:
            print(json.dumps(res.to_json(), indent=2))
        elif args.explain:
            print(res.explain, end="")
        else:
            print(summary(res))
    except BrokenPipeError:  # `rayspeed plan ... | head`
        sys.stderr.close()
    return EXIT_OK
