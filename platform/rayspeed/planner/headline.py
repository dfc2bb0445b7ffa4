"""The first line of `rayspeed plan --explain` when the chosen layout is at the memory edge: where the job stands
and the nearest ways out, each planned (a LoRA adapter on the same workers, twice the workers) with what it needs.

At the edge means the chosen layout does not fit with twice the memory model's own margin (planner/margin.py): a
prediction off by one margin is as likely as not, so a layout that survives only one margin is a coin toss of its
uncertainty, not a comfortable fit. Below that the explanation starts as it always did.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from rayspeed.config.schema import JobConfig


def at_the_edge(best: Any) -> bool:
    return best.memory_gib + 2 * best.margin_gib > best.ctx.usable_gib


def edge_headline(cfg: JobConfig, best: Any, best_for: Callable[[JobConfig, int], Optional[Any]]) -> Optional[str]:
    """The headline, or None when the chosen layout fits comfortably. `best_for(cfg, world)`: the planner's best
    fitting estimate for that job on that many workers (None: nothing fits)."""
    if not at_the_edge(best):
        return None
    ctx = best.ctx
    unit = "GPUs" if ctx.hw.is_gpu else "workers"
    size = f"{ctx.memory_gib:.0f} GiB" if ctx.hw.is_gpu else f"{ctx.memory_gib:.1f} GiB each"
    lora = cfg.model.adapter.type != "none"
    tuned = "fine-tuning" if getattr(cfg.model, "pretrained", None) else "training"
    what = f"LoRA {tuned}" if lora else f"full {tuned}"
    line = (f"{what} of this model on {ctx.world} x {ctx.hw.name} ({size}) is at the memory edge: the chosen layout "
            f"needs {best.memory_text()} of {ctx.usable_gib:.1f} GiB usable (less than twice the model's margin "
            "to spare)")
    ways = []
    if not lora:
        adapted = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, adapter=dataclasses.replace(cfg.model.adapter, type="lora")))
        ways.append(_way("LoRA (model.adapter.type: lora)", best_for(adapted, ctx.world), ctx.usable_gib))
    ways.append(_way(f"{2 * ctx.world} {unit}", best_for(cfg, 2 * ctx.world), ctx.usable_gib))
    return line + "; " + "; ".join(ways)


def _way(name: str, e: Optional[Any], usable: float) -> str:
    if e is None:
        return f"{name} does not fit either"
    return f"{name} fits at {e.memory_text()} ({e.layout.short()}, {100 * (1 - e.memory_gib / usable):.0f}% free)"
