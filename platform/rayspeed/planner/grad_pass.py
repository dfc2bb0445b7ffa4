"""The memory pass every micro-batch's gradients make beyond the backward itself, by DeepSpeed optimizer path."""

from __future__ import annotations

from rayspeed.config.layout import Layout
from rayspeed.planner.inputs import Ctx

# BF16_Optimizer's per-micro-batch `hp_grad.add_(lp_grad.to(fp32))`: read the bf16 gradient and write its fp32 copy
# (2 + 4), then read that copy and the fp32 gradient and write the sum (4 + 4 + 4).
HP_GRAD_BYTES_PER_PARAM = 18


def bf16_optimizer(ctx: Ctx, lay: Layout) -> bool:
    """Whether DeepSpeed 0.19.8 wraps the optimizer in its BF16_Optimizer (engine `_do_optimizer_sanity_check`):
    bf16 weights with fp32 gradient accumulation at ZeRO-1, or bf16 accumulation under the pipeline engine at
    ZeRO-0. It adds each micro-batch's bf16 gradients into full fp32 gradients after that micro-batch's backward
    (`backward_epilogue` -> `update_hp_grads`; under the pipeline engine in `_exec_backward_pass`)."""
    if ctx.precision != "bf16":
        return False
    if ctx.grad_accum_dtype == "fp32":
        return lay.zero_stage == 1
    return lay.zero_stage == 0 and lay.pp > 1


def grad_pass_bytes_per_param(ctx: Ctx, lay: Layout) -> float:
    """Memory traffic per parameter of the stage that every micro-batch's gradients cost beyond the backward itself:
    BF16_Optimizer's fp32 accumulation (HP_GRAD_BYTES_PER_PARAM, on every rank's whole stage), or ZeRO-2's copy of
    each gradient into its reduce bucket in the communication dtype (DeepSpeed stage_1_and_2: the backward hooks
    copy into the ipg buffer) plus the add of the reduced bucket into this rank's fp32 partition (read the bucket's
    slice and the partition, write the partition: 12 bytes over dp)."""
    if bf16_optimizer(ctx, lay):
        return HP_GRAD_BYTES_PER_PARAM
    if lay.zero_stage == 2:
        return ctx.w_bytes + ctx.comm_bytes + 12 / max(1, lay.zero_ranks)
    return 0.0
