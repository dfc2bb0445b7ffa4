"""Model + optimizer + schedule -> a DeepSpeed engine, for any layout the planner emits."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from rayspeed.config.schema import JobConfig
from rayspeed.engine.optim import build_optimizer, build_scheduler

log = logging.getLogger(__name__)


def build_model(cfg: JobConfig, groups: Any) -> torch.nn.Module:
    """The model for this rank: the whole Transformer (sharded over tp), or this stage of the pipeline."""
    par = cfg.parallel
    tp = groups.tp if par.tp > 1 else None
    # The model sees concrete sizes: null kv heads / ffn width resolved from the schema's defaults.
    mcfg = dataclasses.replace(cfg.model, num_kv_heads=cfg.model.kv_heads, ffn_hidden_size=cfg.model.ffn_size)
    preserve_rng = bool(getattr(par, "preserve_rng_state", False))
    if par.pp > 1:
        from rayspeed.model.pipeline import build_pipeline_module

        return build_pipeline_module(
            mcfg,
            groups,
            num_stages=par.pp,
            tp=tp,
            sequence_parallel=bool(par.sequence_parallel),
            activation_checkpointing=par.activation_checkpointing,
            preserve_rng_state=preserve_rng,
            seed=cfg.train.seed,
        )
    from rayspeed.model.transformer import Transformer

    return Transformer(
        mcfg,
        tp=tp,
        sequence_parallel=bool(par.sequence_parallel),
        activation_checkpointing=par.activation_checkpointing,
        preserve_rng_state=preserve_rng,
        seed=cfg.train.seed,
    )


def build_engine(cfg: JobConfig, ds_config: dict, groups: Any, device: torch.device) -> tuple[Any, bool]:
    """(engine, pipelined). deepspeed.initialize runs on the process group Ray (or the local launcher) set up;
    the ParallelGroups object is DeepSpeed's mpu so ZeRO partitions over the data-parallel group only."""
    import deepspeed

    on_gpu = device.type == "cuda"
    if on_gpu:
        # Ampere and newer: TF32 for any fp32 matmul left (playbook B.6).
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model = build_model(cfg, groups)
    if not on_gpu:
        model = model.to(device)
    optimizer = build_optimizer(model, cfg, on_gpu)
    scheduler = build_scheduler(optimizer, cfg)
    pipelined = cfg.parallel.pp > 1
    kwargs: dict[str, Any] = dict(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    if not pipelined:
        kwargs["mpu"] = groups
    engine, _, _, _ = deepspeed.initialize(**kwargs)
    return engine, pipelined
