"""What preference tuning (train.objective: dpo) changes in the memory and time of a step (docs/PLANNER.md, "DPO").

- Two sequences per sample: a micro-batch of b pairs is 2b rows (the chosen and the rejected completion, each padded
  to seq_len), so activations, logits, every GEMM and the tokens per step are those of 2b sequences
  (Ctx.in_rows: the layout keeps counting pairs, the costing sees rows).
- The reference. precomputed (the default): one forward over every pair with the initial weights before step 1, a
  one-off cost reported as seconds per 1,000 pairs (reference_pass_s), nothing per step. resident: a frozen copy of
  the weights in the working precision on every rank (not partitioned by ZeRO: the job checks refuse it with
  ZeRO-3; split over tp like the policy) and one more forward of each micro-batch per step; with an adapter the
  reference is the policy with its adapters off: no copy, the same extra forward. Its forward keeps no activations
  for backward (no grad), so it adds no activation memory beyond the policy's peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rayspeed.planner.model_math import max_stage_params, split_of
from rayspeed.planner.terms import MemoryTerm, TimeTerm, register
from rayspeed.planner.timing import stage_parts  # above timing: its step reads these terms from the registry


@dataclass(frozen=True)
class DpoPlan:
    reference: str  # precomputed | resident
    adapter: bool  # the reference is the policy with its adapters off

    @classmethod
    def of(cls, cfg: Any) -> Optional["DpoPlan"]:
        if getattr(cfg.train, "objective", "sft") != "dpo":
            return None
        from rayspeed.config import adapter

        return cls(reference=cfg.train.dpo.reference, adapter=adapter.enabled(cfg.model.adapter))

    @property
    def forward_per_step(self) -> bool:
        return self.reference == "resident"

    @property
    def copy(self) -> bool:
        return self.reference == "resident" and not self.adapter


def forward_s(ctx: Any, lay: Any) -> float:
    """Seconds of one forward of one micro-batch (in rows) on the slowest stage: its compute minus its backward."""
    return max(comp - back for comp, _, _, back in stage_parts(ctx, lay))


def reference_forward_s(ctx: Any, lay: Any) -> float:
    return lay.grad_accum * forward_s(ctx, lay)


def reference_weight_bytes(ctx: Any, lay: Any, stage: int) -> float:
    return max_stage_params(ctx.shape, lay.tp, lay.pp, split_of(ctx.shape, lay), lay.ep) * ctx.w_bytes


def reference_pass_s(ctx: Any, lay: Any, pairs: int = 1000) -> float:
    """The precomputed reference's one-off pass: every pair's two rows forward once, dp ranks in parallel (a pipeline
    reads grad_accum micro-batches per pass, so its fill is amortised like a training step's)."""
    rows_ctx, rows_lay = ctx.in_rows(lay)
    micro_batches = -(-pairs // (lay.micro_batch_size * lay.dp))
    return micro_batches * forward_s(rows_ctx, rows_lay)


register(MemoryTerm("dpo_reference_weights", applies=lambda ctx, lay: ctx.dpo is not None and ctx.dpo.copy,
                    bytes=reference_weight_bytes, dynamic=False,
                    source="docs/PLANNER.md DPO: a frozen copy of the stage's weights in the working precision"))
register(TimeTerm("dpo_reference_forward_s",
                  applies=lambda ctx, lay: ctx.dpo is not None and ctx.dpo.forward_per_step,
                  seconds=reference_forward_s, kind="compute",
                  source="docs/PLANNER.md DPO: one forward of each micro-batch through the reference (no backward)"))
