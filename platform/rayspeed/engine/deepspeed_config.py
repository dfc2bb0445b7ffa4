"""The DeepSpeed config, generated from the resolved job and its plan.

Pure Python (no torch/deepspeed import): it is unit-tested and logged as config/deepspeed.json. Nothing
"auto" reaches DeepSpeed: every number here comes from the resolved config or the planner.
"""

from __future__ import annotations

from typing import Any

from rayspeed.config.schema import AUTO, JobConfig
from rayspeed.errors import ConfigError

# DeepSpeed's own defaults (5e8 elements) are tuned for big GPU jobs; the planner sizes buckets per job.
_DEFAULT_BUCKET = 500_000_000


def batch_arithmetic_problems(cfg: JobConfig) -> list[str]:
    """train_batch_size = micro x accumulation x dp, checked before DeepSpeed sees it."""
    p = cfg.parallel
    unresolved = [k for k in ("dp", "micro_batch_size", "grad_accum", "zero_stage", "tp", "pp")
                  if getattr(p, k) == AUTO]
    if unresolved:
        return [f"parallel.{k}: still auto when building the DeepSpeed config (the planner must resolve it)"
                for k in unresolved]
    # Returned above on auto: ints from here on.
    assert isinstance(p.micro_batch_size, int) and isinstance(p.grad_accum, int) and isinstance(p.dp, int)
    g = cfg.train.global_batch_size
    if p.micro_batch_size * p.grad_accum * p.dp != g:
        return [
            f"train.global_batch_size ({g}) must equal parallel.micro_batch_size ({p.micro_batch_size}) x "
            f"parallel.grad_accum ({p.grad_accum}) x parallel.dp ({p.dp}) = "
            f"{p.micro_batch_size * p.grad_accum * p.dp}; change one of them or leave them auto"
        ]
    return []


def _ep(par: Any) -> int:
    ep = getattr(par, "ep", 1)
    return ep if isinstance(ep, int) else 1


def _pipeline_cp(par: Any) -> int:
    cp = getattr(par, "cp", 1)
    return cp if isinstance(cp, int) and isinstance(par.pp, int) and par.pp > 1 else 1


def rayspeed_clips(cfg: JobConfig) -> bool:
    """True when the worker clips gradients itself (rayspeed.engine.clip) and DeepSpeed's `gradient_clipping`
    is 0: ZeRO-0, fp32, no pipeline, where DeepSpeed's clip adds a data-parallel all-reduce of norms every
    rank already shares. Other layouts keep DeepSpeed's clipping: its ZeRO and bf16/fp16 optimizers clip their
    own flat fp32 partitions."""
    p, t = cfg.parallel, cfg.train
    return t.grad_clip > 0 and p.zero_stage == 0 and p.pp == 1 and t.precision == "fp32"


def deepspeed_config(cfg: JobConfig, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON for a resolved job. `plan` is the planner's chosen layout (bucket sizes)."""
    problems = batch_arithmetic_problems(cfg)
    if problems:
        raise ConfigError(problems)
    par, train = cfg.parallel, cfg.train
    assert isinstance(par.zero_stage, int) and isinstance(par.pp, int)  # the problems above include auto
    precision = train.precision
    if precision == AUTO:
        raise ConfigError("train.precision: still auto when building the DeepSpeed config "
                          "(the planner must resolve it)")
    ds_plan = (plan or {}).get("deepspeed", {}) or {}
    reduce_bucket = int(ds_plan.get("reduce_bucket_size", _DEFAULT_BUCKET))
    allgather_bucket = int(ds_plan.get("allgather_bucket_size", _DEFAULT_BUCKET))
    on_gpu = cfg.cluster.use_gpu

    zero: dict[str, Any] = {"stage": int(par.zero_stage)}
    if par.zero_stage >= 1:
        zero.update(
            {
                # Overlap the gradient reduce with backward on GPUs (a side stream); on CPU there is no
                # stream to overlap on and it only adds copies.
                "overlap_comm": bool(on_gpu),
                "contiguous_gradients": True,
                "reduce_scatter": True,
                "reduce_bucket_size": reduce_bucket,
                "allgather_bucket_size": allgather_bucket,
            }
        )
    if par.zero_stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": int(ds_plan.get("stage3_prefetch_bucket_size", reduce_bucket)),
                "stage3_param_persistence_threshold": int(ds_plan.get("stage3_param_persistence_threshold", 100_000)),
                "stage3_max_live_parameters": int(ds_plan.get("stage3_max_live_parameters", 1_000_000_000)),
                "stage3_gather_16bit_weights_on_model_save": False,
            }
        )
    for key in ("zero_hpz_partition_size",):  # ZeRO++ hierarchical partitioning (playbook B.2, 64-256 GPUs)
        if key in ds_plan and par.zero_stage == 3:
            zero[key] = int(ds_plan[key])

    ds: dict[str, Any] = {
        # Under ep DeepSpeed's data-parallel group is the experts' (dp / ep ranks), and under pp with cp the pipeline
        # grid's data axis is dp x cp ranks (engine/pipeline_module.py): its batch arithmetic with them.
        "train_batch_size": train.global_batch_size // _ep(par) * _pipeline_cp(par),
        "train_micro_batch_size_per_gpu": int(par.micro_batch_size),
        "gradient_accumulation_steps": int(par.grad_accum),
        # ZeRO-0 fp32: the worker clips (rayspeed.engine.clip), without DeepSpeed's extra all-reduce.
        "gradient_clipping": 0.0 if rayspeed_clips(cfg) else float(train.grad_clip),
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        # The client optimizer (torch AdamW) avoids building DeepSpeed's fused ops; ZeRO wraps it.
        "zero_allow_untested_optimizer": True,
        # Gradients are reduced in fp32: the field guide's "precision drift" remedy (PLAYBOOK B.9).
        "communication_data_type": "fp32",
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
        "checkpoint": {"load_universal": False},
    }
    if precision in ("bf16", "fp16"):
        ds["data_types"] = {"grad_accum_dtype": train.grad_accum_dtype}
    if par.pp > 1:
        ds["pipeline"] = {"activation_checkpoint_interval": 0}
    return ds
