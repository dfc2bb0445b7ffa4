"""`rayspeed plan FILE [--set K=V]... [--json] [--top K] [--layouts FILE.jsonl] [--explain] [--world-size N]
[--profile FILE] [--calibrate-from EXPERIMENT]`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from rayspeed.errors import EXIT_BAD_INPUT, EXIT_OK, ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rayspeed plan", description="Choose the parallel layout for a job "
                                "(pure arithmetic: no GPU, Ray or torch needed).")
    p.add_argument("file", help="job YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key (value parsed as YAML); repeatable")
    p.add_argument("--json", action="store_true", help='print {"plan": ..., "alternatives": [...], "explain": ...}')
    p.add_argument("--top", type=int, default=5, metavar="K", help="runner-up layouts to show (default 5)")
    p.add_argument("--layouts", metavar="FILE.jsonl", help="evaluate these layouts (one JSON object per line) "
                   "and print one JSON line each, in order")
    p.add_argument("--explain", action="store_true", help="print the full explanation")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="plan for N workers instead of cluster.num_workers (its maximum when elastic)")
    p.add_argument("--profile", metavar="FILE", help="a hardware profile from `rayspeed calibrate` (overrides "
                   "cluster.profile; precedence: profile > cluster.hardware > the built-in table)")
    p.add_argument("--calibrate-from", metavar="EXPERIMENT", help="fit the profile's efficiency factors to the "
                   "finished runs of this MLflow experiment (leave-one-out error reported), save it, plan with it")
    return p


def _summary(res) -> str:
    b = res.best
    lines = [
        f"layout: dp {b['dp']} x tp {b['tp']} x pp {b['pp']}, ZeRO-{b['zero_stage']}, micro-batch "
        f"{b['micro_batch_size']} x accumulation {b['grad_accum']}, sequence_parallel {b['sequence_parallel']}, "
        f"activation_checkpointing {b['activation_checkpointing']}",
        f"memory: {b['memory_gib_per_gpu']:.2f} GiB per {'worker' if b['gpu'] == 'cpu' else 'GPU'} (worst rank) of {b['usable_memory_gib']:.2f} usable: "
        + ", ".join(f"{k} {v:.3g}" for k, v in b["memory_breakdown_gib"].items() if v > 0),
        f"time: {b['step_time_s']:.4f} s per step, {b['tokens_per_s_per_gpu']:,.0f} tokens/s per "
        f"{'worker' if b['gpu'] == 'cpu' else 'GPU'}, "
        f"MFU {100 * b['mfu']:.1f}% ({b['world_size']} x {b['gpu']}, {b['precision']})",
        f"strategy rule: {res.rules['strategy']['recommends']} ({res.rules['strategy']['note']})",
        "run with --explain for the reasons and the runner-ups",
    ]
    return "\n".join(lines)


def _fit_summary(fitted: dict, path: str) -> str:
    f, e = fitted["fit"], fitted["efficiency"]
    loo = f["loo_median_abs_error"]
    return (f"calibrated from {f['runs']} run(s) of '{f['experiment']}': efficiency compute {e['compute']}, comm "
            f"{e['comm']}, overhead {e['overhead']}; held-out (leave-one-out) median error "
            f"{'%.1f%%' % (100 * loo) if loo is not None else 'n/a (one run)'} (unfitted "
            f"{100 * f['unfitted_median_abs_error']:.1f}%); profile saved to {path}")


def _evaluate_file(cfg, path: str, world_size, profile=None) -> list[str]:
    from rayspeed.planner import evaluate_layout

    try:
        with open(path) as fh:
            raw = fh.read().splitlines()
    except OSError as e:
        raise ConfigError(f"--layouts {path}: cannot read ({e.strerror})") from None
    out = []
    for i, line in enumerate(raw, 1):
        if not line.strip():
            continue
        try:
            layout = json.loads(line)
            if not isinstance(layout, dict):
                raise ValueError("not an object")
        except ValueError as e:
            out.append(json.dumps({"fits": False, "valid": False, "reason": f"line {i}: not a JSON object ({e})"}))
            continue
        out.append(json.dumps(evaluate_layout(cfg, layout, world_size, profile=profile)))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plan" and not os.path.exists("plan"):  # `rayspeed plan FILE` or `plan FILE`
        argv = argv[1:]
    args = _parser().parse_args(argv)
    try:
        from rayspeed.config.load import load
        from rayspeed.planner import plan_job

        cfg = load(args.file, args.overrides)
        if args.world_size is not None and args.world_size < 1:
            raise ConfigError(f"--world-size: must be >= 1, got {args.world_size}")
        profile = args.profile
        if args.calibrate_from:
            from rayspeed.planner.calibfit import calibrate_from

            fitted, profile = calibrate_from(cfg, args.calibrate_from, args.profile)
            print(_fit_summary(fitted, profile), file=sys.stderr)
        if args.layouts:
            for line in _evaluate_file(cfg, args.layouts, args.world_size, profile):
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
            print(_summary(res))
    except BrokenPipeError:  # `rayspeed plan ... | head`
        sys.stderr.close()
    return EXIT_OK


if __name__ == "__main__":  # python -m rayspeed.planner.cli plan FILE ...
    sys.exit(main())
