"""What `rayspeed plan` prints: the short summary, one JSON verdict per given layout, the profile fit's line.
(The command itself is rayspeed.planning; the arguments are declared in rayspeed.cli.)"""

from __future__ import annotations

import json
from typing import Any

from rayspeed.errors import ConfigError


def summary(res: Any) -> str:
    b = res.best
    unit = "worker" if b["gpu"] == "cpu" else "GPU"
    cp = f" x cp {b['cp']} ({b['cp_scheme']})" if b.get("cp", 1) > 1 else ""
    cp += f" (experts over ep {b['ep']})" if b.get("ep", 1) > 1 else ""
    lines = [
        f"layout: dp {b['dp']}{cp} x tp {b['tp']} x pp {b['pp']}, ZeRO-{b['zero_stage']}, micro-batch "
        f"{b['micro_batch_size']} x accumulation {b['grad_accum']}, sequence_parallel {b['sequence_parallel']}, "
        f"activation_checkpointing {b['activation_checkpointing']}",
        f"memory: {b['memory_gib_per_gpu']:.2f} GiB per {unit} (worst rank) of {b['usable_memory_gib']:.2f} usable: "
        + ", ".join(f"{k} {v:.3g}" for k, v in b["memory_breakdown_gib"].items() if v > 0),
        f"time: {b['step_time_s']:.4f} s per step, {b['tokens_per_s_per_gpu']:,.0f} tokens/s per {unit}, "
        f"MFU {100 * b['mfu']:.1f}% ({b['world_size']} x {b['gpu']}, {b['precision']})",
        *([f"dpo: a micro-batch of {b['micro_batch_size']} pairs is {2 * b['micro_batch_size']} sequences; the "
           f"reference pass before step 1 takes about {b['dpo_reference_pass_s_per_1000_pairs']:.3g} s per 1,000 "
           "pairs"] if b.get("dpo_reference_pass_s_per_1000_pairs") is not None else []),
        *([f"grpo: each rank samples its {b['grpo_rollout']['completions_per_rank']} completions at once between "
           f"steps: a key/value cache of {b['grpo_rollout']['kv_cache_gib']:.3g} GiB, about "
           f"{b['grpo_rollout']['sampling_s']:.3g} s of sampling per step (in the step time)"]
          if b.get("grpo_rollout") else []),
        f"strategy rule: {res.rules['strategy']['recommends']} ({res.rules['strategy']['note']})",
        "run with --explain for the reasons and the runner-ups",
    ]
    return "\n".join(lines)


def fit_summary(fitted: dict, path: str) -> str:
    f, e = fitted["fit"], fitted["efficiency"]
    loo = f["loo_median_abs_error"]
    return (f"calibrated from {f['runs']} run(s) of '{f['experiment']}': efficiency compute {e['compute']}, comm "
            f"{e['comm']}, overhead {e['overhead']}; held-out (leave-one-out) median error "
            f"{'%.1f%%' % (100 * loo) if loo is not None else 'n/a (one run)'} (unfitted "
            f"{100 * f['unfitted_median_abs_error']:.1f}%); profile saved to {path}")


def evaluate_file(cfg: Any, path: str, world_size: int | None, profile: Any = None) -> list[str]:
    """One JSON verdict per line of a --layouts file, in order (a line that is not a JSON object says so)."""
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
