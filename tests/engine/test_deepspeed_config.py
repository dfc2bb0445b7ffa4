"""DeepSpeed config generation from a resolved job: numbers only, batch arithmetic checked first."""

import dataclasses
import json

import pytest

from rayspeed.config import parse
from rayspeed.engine.deepspeed_config import deepspeed_config
from rayspeed.errors import ConfigError


def resolved(**parallel):
    p = dict(dp=2, tp=1, pp=1, zero_stage=2, micro_batch_size=4, grad_accum=2, sequence_parallel=False,
             activation_checkpointing="none")
    p.update(parallel)
    return parse({"train": {"global_batch_size": 16, "precision": "fp32", "lr": 1e-3, "grad_clip": 0.5}, "parallel": p})


def _no_auto(obj):
    if isinstance(obj, dict):
        return all(_no_auto(v) for v in obj.values())
    if isinstance(obj, list):
        return all(_no_auto(v) for v in obj)
    return obj != "auto"


def test_zero2_fp32():
    ds = deepspeed_config(resolved())
    assert ds["train_batch_size"] == 16
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 2
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["overlap_comm"] is False  # CPU job
    assert ds["bf16"]["enabled"] is False and ds["fp16"]["enabled"] is False
    assert ds["gradient_clipping"] == 0.5
    assert ds["communication_data_type"] == "fp32"
    assert "data_types" not in ds
    assert _no_auto(ds)
    json.dumps(ds)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_zero_stage(stage):
    ds = deepspeed_config(resolved(zero_stage=stage))
    z = ds["zero_optimization"]
    assert z["stage"] == stage
    assert ("reduce_bucket_size" in z) == (stage >= 1)
    assert ("stage3_prefetch_bucket_size" in z) == (stage == 3)



def test_clipping_owner():
    """ZeRO-0 fp32 without a pipeline: the worker clips (DeepSpeed's clipping off); everywhere else DeepSpeed."""
    from rayspeed.engine.deepspeed_config import rayspeed_clips

    z0 = resolved(zero_stage=0)
    assert rayspeed_clips(z0) and deepspeed_config(z0)["gradient_clipping"] == 0.0
    for other in (resolved(zero_stage=1), resolved(zero_stage=0, pp=2, dp=1, grad_accum=4),
                  dataclasses.replace(z0, train=dataclasses.replace(z0.train, precision="bf16"))):
        assert not rayspeed_clips(other) and deepspeed_config(other)["gradient_clipping"] == 0.5
    no_clip = dataclasses.replace(z0, train=dataclasses.replace(z0.train, grad_clip=0.0))
    assert not rayspeed_clips(no_clip) and deepspeed_config(no_clip)["gradient_clipping"] == 0.0

def test_bf16_and_grad_accum_dtype_and_planner_buckets():
    cfg = resolved(zero_stage=3)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision="bf16", grad_accum_dtype="bf16"),
                              cluster=dataclasses.replace(cfg.cluster, use_gpu=True))
    ds = deepspeed_config(cfg, {"deepspeed": {"reduce_bucket_size": 1234, "allgather_bucket_size": 5678}})
    assert ds["bf16"]["enabled"] and ds["data_types"]["grad_accum_dtype"] == "bf16"
    assert ds["zero_optimization"]["reduce_bucket_size"] == 1234
    assert ds["zero_optimization"]["allgather_bucket_size"] == 5678
    assert ds["zero_optimization"]["overlap_comm"] is True


def test_pipeline_section():
    ds = deepspeed_config(resolved(pp=2, dp=1, zero_stage=1, micro_batch_size=4, grad_accum=4))
    assert "pipeline" in ds and ds["train_batch_size"] == 16


def test_batch_arithmetic_checked_before_deepspeed():
    with pytest.raises(ConfigError) as ei:
        deepspeed_config(resolved(grad_accum=3))
    msg = ei.value.render()
    assert ("train.global_batch_size (16) must equal parallel.micro_batch_size (4) x parallel.grad_accum (3) "
            "x parallel.dp (2) = 24") in msg


def test_auto_never_reaches_deepspeed():
    with pytest.raises(ConfigError) as ei:
        deepspeed_config(resolved(zero_stage="auto"))
    assert "parallel.zero_stage" in ei.value.render()
