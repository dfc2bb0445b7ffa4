"""What DeepSpeed 0.19.8's engine does per micro-batch and what it refuses, in the planner: the ZeRO-0 path it does
not have (bf16/fp16 weights with fp32 gradient accumulation), BF16_Optimizer's and ZeRO-2's pass over every
micro-batch's gradients, and the pipeline engine's host floor per micro-batch."""

import dataclasses

import pytest

from rayspeed.config.layout import Layout
from rayspeed.config.load import parse
from rayspeed.errors import ConfigError
from rayspeed.planner import evaluate_layout, plan_job
from rayspeed.planner.grad_pass import HP_GRAD_BYTES_PER_PARAM, grad_pass_bytes_per_param
from rayspeed.planner.search import build_ctx, enumerate_layouts
from rayspeed.planner.timing import stage_parts, step_time

JOB = {"model": {"hidden_size": 2048, "num_layers": 16, "num_heads": 16, "ffn_hidden_size": 5632,
                 "vocab_size": 32000, "seq_len": 2048},
       "train": {"global_batch_size": 64, "precision": "bf16"}, "cluster": {"num_workers": 8, "use_gpu": True}}


def _job(**train):
    return parse({**JOB, "train": {**JOB["train"], **train}})


def test_zero0_is_never_planned_for_half_precision_with_fp32_accumulation():
    ctx = build_ctx(_job(grad_accum_dtype="fp32"))
    layouts = enumerate_layouts(ctx, {}).layouts
    assert layouts and all(lay.zero_stage > 0 for lay in layouts)
    ctx16 = build_ctx(_job(grad_accum_dtype="bf16"))
    assert any(lay.zero_stage == 0 for lay in enumerate_layouts(ctx16, {}).layouts)  # bf16 accumulation: allowed


def test_a_fixed_zero0_with_fp32_accumulation_names_both_keys_and_the_fix():
    cfg = _job(grad_accum_dtype="fp32")
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero_stage=0))
    with pytest.raises(ConfigError) as ei:
        plan_job(cfg)
    msg = ei.value.render()
    assert "parallel.zero_stage 0" in msg and "train.grad_accum_dtype" in msg and "zero_stage 1" in msg
    got = evaluate_layout(_job(grad_accum_dtype="fp32"), {"tp": 1, "pp": 1, "zero_stage": 0,
                                                          "micro_batch_size": 1})
    assert not got["runnable"] and "grad_accum_dtype" in got["reason"]


def test_bf16_optimizer_and_zero2_pass_over_every_micro_batchs_gradients():
    ctx = build_ctx(_job(grad_accum_dtype="fp32"))

    def lay(zero, mb, ga, pp=1):
        return Layout(8 // pp, 1, pp, zero, mb, ga, False, "none")

    assert grad_pass_bytes_per_param(ctx, lay(1, 1, 8)) == HP_GRAD_BYTES_PER_PARAM  # BF16_Optimizer at ZeRO-1
    assert grad_pass_bytes_per_param(ctx, lay(2, 1, 8)) == pytest.approx(2 + 4 + 12 / 8)  # ZeRO-2's bucket copy
    assert grad_pass_bytes_per_param(ctx, lay(3, 1, 8)) == 0.0
    # The pass does not shrink with the micro-batch: the same tokens in 8 micro-batches of 1 cost more than in 1 of 8
    # by at least 7 more passes.
    few, many = step_time(ctx, lay(1, 8, 1)), step_time(ctx, lay(1, 1, 8))
    one_pass = HP_GRAD_BYTES_PER_PARAM * ctx.shape.params / (ctx.hw.hbm_gbps * 1e9 * ctx.hw.mem_efficiency)
    assert many.compute_s - few.compute_s > 7 * one_pass * 0.99
    ctx_fp32 = build_ctx(parse({**JOB, "train": {**JOB["train"], "precision": "fp32"}}))
    assert grad_pass_bytes_per_param(ctx_fp32, lay(1, 1, 8)) == 0.0  # no BF16_Optimizer in fp32


def test_the_pipeline_engine_costs_a_host_floor_per_micro_batch_on_every_stage():
    job = parse({**JOB, "model": {**JOB["model"], "hidden_size": 256, "ffn_hidden_size": 704, "num_heads": 4,
                                  "seq_len": 128}})
    ctx = build_ctx(job)
    pp = Layout(1, 1, 8, 1, 1, 8, False, "none", stage_layers=(2,) * 8)
    floor = ctx.hw.pipe_host_mb_us * 1e-6
    for comp, _, _, _ in stage_parts(ctx, pp):
        assert comp >= floor  # a tiny stage's micro-batch cannot beat the engine's own host time
    without = dataclasses.replace(ctx, hw=dataclasses.replace(ctx.hw, pipe_host_mb_us=0.0))
    assert step_time(ctx, pp).step_s > step_time(without, pp).step_s


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_cpu_workers_hide_no_communication_and_gpus_pay_the_overlap_tax(zero, monkeypatch):
    """gloo has no side stream: on CPU workers every collective adds to the step, ZeRO-3's forward gathers too. On
    GPUs what hides behind compute (ZeRO-1 to 3) still costs OVERLAP_TAX of its time."""
    from rayspeed.planner import timing

    lay = Layout(dp=8, tp=1, pp=1, zero_stage=zero, micro_batch_size=1, grad_accum=8)
    cpu = step_time(build_ctx(parse({**JOB, "train": {**JOB["train"], "precision": "fp32"},
                                     "cluster": {"num_workers": 8}})), lay)
    assert cpu.dp_comm_s == pytest.approx(cpu.dp_comm_total_s, rel=1e-9) and cpu.dp_comm_s > 0
    if zero:
        gpu_ctx = build_ctx(_job(grad_accum_dtype="fp32"))
        taxed, tax = step_time(gpu_ctx, lay), timing.OVERLAP_TAX
        monkeypatch.setattr(timing, "OVERLAP_TAX", 0.0)
        free = step_time(gpu_ctx, lay)
        hidden = free.dp_comm_total_s - free.dp_comm_s
        assert hidden > 0
        assert tax > 0 and taxed.dp_comm_s == pytest.approx(free.dp_comm_s + tax * hidden, rel=1e-9)
