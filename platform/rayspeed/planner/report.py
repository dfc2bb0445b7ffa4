"""`rayspeed plan FILE [--set K=V]... [--json] [--top K] [--layouts FILE.jsonl] [--explain] [--world-size N]`:
what it prints (the arguments are declared in rayspeed.cli)."""

from __future__ import annotations

import argparse
import json
import sys

from rayspeed.errors import EXIT_BAD_INPUT, EXIT_OK, ConfigError


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


def _evaluate_file(cfg, path: str, world_size) -> list[str]:
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
        out.append(json.dumps(evaluate_layout(cfg, layout, world_size)))
    return out


def plan_command(args: argparse.Namespace) -> int:
    """`rayspeed plan`: the plan, its JSON, its explanation, or one verdict per given layout."""
    try:
        from rayspeed.config.load import load
        from rayspeed.planner import plan_job

        cfg = load(args.file, args.overrides)
        if args.world_size is not None and args.world_size < 1:
            raise ConfigError(f"--world-size: must be >= 1, got {args.world_size}")
        if args.layouts:
            for line in _evaluate_file(cfg, args.layouts, args.world_size):
                print(line)
            return EXIT_OK
        res = plan_job(cfg, world_size=args.world_size, top_k=max(0, args.top))
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
