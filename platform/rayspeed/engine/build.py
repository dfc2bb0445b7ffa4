"""Model + optimizer + schedule -> a DeepSpeed engine, for any layout the planner emits."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from rayspeed.config.schema import JobConfig
from rayspeed.config.shape import ModelShape
from rayspeed.engine.optim import build_optimizer, build_scheduler

log = logging.getLogger(__name__)


def loads_pretrained(cfg: JobConfig) -> bool:
    """Whether the initial weights come from model.pretrained's safetensors (train.init_from overrides them, unless
    it is a PEFT adapter, which continues on them)."""
    from rayspeed.config.adapter import init_adapter_dir

    return (bool(cfg.model.pretrained) and cfg.model.init == "pretrained"
            and (not cfg.train.init_from or init_adapter_dir(cfg) is not None))


def build_model(cfg: JobConfig, groups: Any, shape: Optional[ModelShape] = None) -> torch.nn.Module:
    """The model for this rank as built: the whole Transformer (sharded over tp), or this stage of the pipeline,
    before any transform (rayspeed.engine.transforms). With model.pretrained (init: pretrained) its weights are
    this rank's slices of the checkpoint. shape: the attempt's (built once by the trainer), else cfg.model's."""
    shape = shape or ModelShape.from_config(cfg.model)
    if not loads_pretrained(cfg):
        return _build_model(cfg, groups, shape)
    from rayspeed.model.hf_weights import load_hf_weights, local_model_dir
    from rayspeed.parallel.layers import deferred_init

    with deferred_init():  # every value is overwritten by the load: no seeded full tensors
        model = _build_model(cfg, groups, shape)
    _shard_experts_before_load(model, groups)
    model_dir = local_model_dir(str(cfg.model.pretrained))
    assert isinstance(cfg.parallel.tp, int)  # _build_model compared it with 1: not auto
    report = load_hf_weights(model, model_dir, shape, tp=groups.tp if cfg.parallel.tp > 1 else None)
    log.info("model.pretrained %s: %d parameters, %d elements (%.1f MB) read from %s", cfg.model.pretrained,
             report["parameters"], report["elements"], report["bytes_read"] / 1e6, model_dir)
    return model


def _shard_experts_before_load(model: torch.nn.Module, groups: Any) -> None:
    """Under expert parallelism each rank keeps its experts' rows before the checkpoint is read, so it reads only
    their tensors (the full stacks, allocated and never touched, are dropped here); the expert_parallel transform
    then finds them sharded."""
    ep = getattr(groups, "ep", None)
    if ep is None or not ep.enabled:
        return
    from rayspeed.model.moe import MoE

    for m in model.modules():
        if isinstance(m, MoE):
            m.shard_experts(ep)


def _build_model(cfg: JobConfig, groups: Any, mcfg: ModelShape) -> torch.nn.Module:
    par = cfg.parallel
    assert isinstance(par.tp, int) and isinstance(par.pp, int)  # a resolved job: the planner left no auto
    tp = groups.tp if par.tp > 1 else None
    if par.pp > 1:
        from rayspeed.engine.pipeline_module import build_pipeline_module

        return build_pipeline_module(
            mcfg,
            groups,
            num_stages=par.pp,
            tp=tp,
            sequence_parallel=bool(par.sequence_parallel),
            seed=cfg.train.seed,
            stage_layers=getattr(par, "stage_layers", None) or None,
            cp=getattr(groups, "cp", None),
        )
    from rayspeed.model.transformer import Transformer

    return Transformer(mcfg, tp=tp, sequence_parallel=bool(par.sequence_parallel), seed=cfg.train.seed,
                       cp=getattr(groups, "cp", None))


def build_engine(cfg: JobConfig, ds_config: dict, groups: Any, device: torch.device,
                 shape: Optional[ModelShape] = None) -> tuple[Any, bool]:
    """(engine, pipelined). deepspeed.initialize runs on the process group Ray (or the local launcher) set up;
    the ParallelGroups object is DeepSpeed's mpu so ZeRO partitions over the data-parallel group only. shape: the
    attempt's ModelShape (built once by the trainer), else cfg.model's."""
    import deepspeed

    from rayspeed import compat

    on_gpu = device.type == "cuda"
    if on_gpu:
        # Ampere and newer: TF32 for any fp32 matmul left (playbook B.6).
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    from rayspeed.config.adapter import init_adapter_dir

    shape = shape or ModelShape.from_config(cfg.model)
    model = build_model(cfg, groups, shape)
    assert isinstance(cfg.parallel.tp, int) and isinstance(cfg.parallel.pp, int)  # build_model read them: not auto
    adapter_dir = init_adapter_dir(cfg)
    if cfg.train.init_from and adapter_dir is None:  # warm start: initial weights from an exported model
        warm_start(model, cfg, groups, shape)
    if not on_gpu:
        model = model.to(device)
    from rayspeed.engine.transforms import apply_transforms

    apply_transforms(model, cfg, groups, on_gpu)  # in their declared order, after the weights are in
    if adapter_dir is not None:  # continue a PEFT adapter made elsewhere on model.pretrained's weights
        from rayspeed.adapters.peft_files import load_peft_dir
        from rayspeed.model.decoder import canonical_named_parameters

        named = canonical_named_parameters(model) if cfg.parallel.pp > 1 else model.named_parameters()
        n = load_peft_dir(model, adapter_dir, shape, groups.tp if cfg.parallel.tp > 1 else None,
                          full_params=dict(named))
        log.info("adapter warm start from the PEFT adapter %s: %d tensors; optimizer starts fresh", adapter_dir, n)
    optimizer = build_optimizer(model, cfg, on_gpu)
    scheduler = build_scheduler(optimizer, cfg)
    pipelined = cfg.parallel.pp > 1
    kwargs: dict[str, Any] = dict(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    if not pipelined:
        kwargs["mpu"] = groups
        if getattr(groups, "ep_size", 1) > 1:  # ZeRO over the ranks holding the same experts
            from rayspeed.parallel.expert_parallel import DeepSpeedView

            kwargs["mpu"] = DeepSpeedView(groups)
    if cfg.parallel.zero_stage == 3 and getattr(groups, "cp_size", 1) > 1:  # ZeRO-3 partitions over dp x cp
        compat.zero3_partition_over(model, groups.dpcp_group, ds_config, groups)
    compat.muon_compiled_on_first_use()
    engine, _, _, _ = deepspeed.initialize(**kwargs)
    return engine, pipelined


def warm_start(model: torch.nn.Module, cfg: JobConfig, groups: Any = None,
               shape: Optional[ModelShape] = None) -> dict[str, Any]:
    """Resolve train.init_from (downloaded once per machine into <storage>/.cache/models) and load it into the
    freshly built model; the optimizer starts fresh."""
    from pathlib import Path

    from rayspeed.model.warm_start import CONFIG, WarmStartError, load_initial_weights
    from rayspeed.paths import model_cache_dir, storage_path, tracking_uri
    from rayspeed.tracking.model_fetch import resolve_init_from

    spec = str(cfg.train.init_from)
    tp = None
    if groups is not None:
        assert isinstance(cfg.parallel.tp, int)  # a resolved job: the planner left no auto
        tp = groups.tp if cfg.parallel.tp > 1 else None
    model_dir = resolve_init_from(spec, tracking_uri(cfg), model_cache_dir(storage_path(cfg)))
    if (Path(model_dir) / CONFIG).is_file():
        report = load_initial_weights(model, model_dir, tp=tp, model_cfg=cfg.model)
    else:  # a Hugging Face directory: same shape required, weights only
        from rayspeed.model.hf_weights import hf_dir_mismatches, load_hf_weights

        shape = shape or ModelShape.from_config(cfg.model)
        bad = hf_dir_mismatches(model_dir, shape)
        if bad:
            raise WarmStartError(f"train.init_from: {spec} is a different model than this job's ({'; '.join(bad)})")
        report = load_hf_weights(model, model_dir, shape, tp=tp, what="train.init_from")
    report["init_from"] = spec
    log.info("warm start from %s (%s): %d parameters, %d elements loaded; optimizer starts fresh",
             spec, model_dir, report["parameters"], report["elements"])
    return report


def base_state(cfg: JobConfig) -> dict[str, Any]:
    """The whole fp32 weights the job started from, under rayspeed's names, re-read from where warm_start or the
    pretrained load took them (train.init_from, else model.pretrained): what a QLoRA job's adapter merges into,
    instead of the 4-bit weights it trained against."""
    from pathlib import Path

    from rayspeed.config.adapter import init_adapter_dir
    from rayspeed.model.hf_weights import local_model_dir, read_whole
    from rayspeed.model.warm_start import CONFIG, WEIGHTS, find_model_dir
    from rayspeed.paths import model_cache_dir, storage_path, tracking_uri
    from rayspeed.tracking.model_fetch import resolve_init_from

    shape = ModelShape.from_config(cfg.model)
    if not cfg.train.init_from or init_adapter_dir(cfg):
        return read_whole(local_model_dir(str(cfg.model.pretrained)), shape)
    root = Path(resolve_init_from(str(cfg.train.init_from), tracking_uri(cfg), model_cache_dir(storage_path(cfg))))
    model_dir = find_model_dir(root) or root
    if (model_dir / CONFIG).is_file():
        state = torch.load(model_dir / WEIGHTS, map_location="cpu", weights_only=True)
        return {k: v.float() for k, v in state.items()}
    return read_whole(str(model_dir), shape, what="train.init_from")
