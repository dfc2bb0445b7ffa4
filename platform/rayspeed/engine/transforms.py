"""What is done to the model of a rank, in one declared order, after it is built and its weights are in:

    tensor_parallel -> expert_parallel -> pipeline_split -> router_freeze -> adapters -> image_path -> context_parallel
        -> activation_checkpointing -> compile

    applied = apply_transforms(model, cfg, groups, on_gpu)     # [(name, what it did)], logged as one line

Tensor parallelism and the pipeline split happen at build (`at_build`): each rank constructs only its shards and
its stage, seeded so that every layout starts from the single-worker weights (building the whole model to
shard it afterwards would hold every weight on every rank). The others change a built model in place. expert
parallelism, adapters and context parallelism are slots: their features put a transform there, in this order
(adapters wrap the sharded linear layers after the weights are loaded; context parallelism replaces attention;
recomputation and compile wrap whatever the model is by then).

Each transform says what it changes in the checkpoint name map (rayspeed parameter name <-> saved tensor), which
the checkpoint and the export read: nothing, today, but for tp/pp (shards and stages, undone by consolidation).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from rayspeed.logs import log_rank

log = logging.getLogger(__name__)

Apply = Callable[[torch.nn.Module, Any, Any, bool], Optional[str]]


@dataclass(frozen=True)
class Transform:
    name: str
    name_map: str
    """What it changes in the checkpoint name map."""
    apply: Optional[Apply] = None
    """(model, cfg, groups, on_gpu) -> what it did (None: nothing for this job); None: a slot, or at build."""
    at_build: Optional[Callable[[Any], Optional[str]]] = None
    """For a transform done by the construction: cfg -> what it did (None: not for this job)."""


def _tensor_parallel(cfg: Any) -> Optional[str]:
    p = cfg.parallel
    return f"tp {p.tp}" + (", sequence parallel" if p.sequence_parallel else "") if p.tp > 1 else None


def _pipeline_split(cfg: Any) -> Optional[str]:
    p = cfg.parallel
    return f"pp {p.pp}" + (f", stage layers {list(p.stage_layers)}" if p.stage_layers else "") if p.pp > 1 else None


def _activation_checkpointing(model: torch.nn.Module, cfg: Any, groups: Any, on_gpu: bool) -> Optional[str]:
    from rayspeed.model.transformer import check_mode

    mode = check_mode(cfg.parallel.activation_checkpointing)
    if mode == "none":
        return None
    # A family's own block (rayspeed.model.families) recomputes through the same attribute.
    blocks = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "activation_checkpointing")]
    if not blocks:
        raise ValueError(f"parallel.activation_checkpointing {mode}: the model has no block to recompute")
    for b in blocks:
        # torch types Module.__setattr__'s value as Tensor | Module; a plain attribute is allowed at run time
        b.activation_checkpointing = mode  # type: ignore[assignment]
    return f"{mode} on {len(blocks)} blocks"


def _expert_parallel(model: torch.nn.Module, cfg: Any, groups: Any, on_gpu: bool) -> Optional[str]:
    """Each rank keeps its experts; the weights every ep rank holds alike average their gradients over ep as they
    accumulate (hooks registered before DeepSpeed's own, which then reduce over the ranks holding the same
    experts: rayspeed.parallel.expert_parallel.DeepSpeedView)."""
    ep = getattr(groups, "ep", None)
    if ep is None or not ep.enabled:
        return None
    from rayspeed.model.moe import MoE
    from rayspeed.parallel.expert_parallel import average_over_ep

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for m in layers:
        m.shard_experts(ep)
    shared = [p for p in model.parameters() if not getattr(p, "expert_parallel", False)]
    average_over_ep(shared, ep)
    if not getattr(groups, "tp", None) or not groups.tp.enabled:
        # Unsplit at tp 1, but built with their split dimension marked: DeepSpeed would count them in a gradient
        # norm on every ep rank (it counts marked weights on each piece of a replica), not once.
        for p in shared:
            p.tensor_model_parallel = False  # type: ignore[attr-defined]  # a tag torch's stubs do not know
    elif ep.rank > 0:  # tp shards: counted on each tp rank, and once over the ep ranks that hold them alike
        from rayspeed.compat.deepspeed_internals import counted_once_in_norm

        counted_once_in_norm(p for p in shared if getattr(p, "tensor_model_parallel", False))
    held = ep.local_experts(layers[0].num_experts) if layers else range(0)
    return f"ep {ep.world_size}: experts {held.start}..{held.stop - 1} of {len(layers)} MoE layers on this rank"


def _router_freeze(model: torch.nn.Module, cfg: Any, groups: Any, on_gpu: bool) -> Optional[str]:
    if not cfg.model.freeze_router:
        return None
    from rayspeed.model.moe import MoE

    routers = [m.router for m in model.modules() if isinstance(m, MoE)]
    for router in routers:
        router.weight.requires_grad_(False)
    return f"{len(routers)} routers frozen"


def _adapters(model: torch.nn.Module, cfg: Any, groups: Any, on_gpu: bool) -> Optional[str]:
    from rayspeed.adapters.attach import add_adapters, trainable_count
    from rayspeed.config import adapter as spec
    from rayspeed.model.transformer import OutputHead, RMSNorm
    from rayspeed.parallel.layers import VocabParallelEmbedding

    a = cfg.model.adapter
    if not spec.enabled(a):
        return None
    tp = groups.tp if cfg.parallel.tp > 1 else None
    packed = ""
    if a.base_precision == "nf4":  # before the adapters: DoRA's magnitude starts from the 4-bit weight (peft's)
        from rayspeed.adapters.nf4 import quantize_base

        n = quantize_base(model, double_quant=a.double_quant, compute=a.compute_dtype, tp=tp)
        packed = f"; {n} base linear layers in NF4{' (double quant)' if a.double_quant else ''}"
    adapted = add_adapters(model, a, tp, bool(cfg.parallel.sequence_parallel), cfg.train.seed)
    kinds = {"embed": VocabParallelEmbedding, "head": OutputHead, "norms": RMSNorm}
    full = tuple(kinds[w] for w in a.trainable)
    for m in model.modules():
        if full and isinstance(m, full):
            for p in m.parameters(recurse=False):
                p.requires_grad_(True)
    train, total = trainable_count(model)
    kind = "DoRA" if a.dora else "rsLoRA" if a.rslora else "LoRA"
    extra = f", {'+'.join(a.trainable)} in full" if a.trainable else ""
    extra = "".join(f", {r} rank {spec.role_rank(a, r)} scale {spec.scale(a, r):g}"
                    for r in spec.target_roles(a) if r in a.rank_pattern or r in a.alpha_pattern) + extra
    roles = sorted({spec.role_of(name) for name in adapted}, key=list(spec.ROLES).index)  # what was adapted
    return (f"{kind} rank {a.rank} scale {spec.scale(a):g} on {len(adapted)} layers "
            f"({','.join(roles)}){extra}; {train} of {total} parameters of this rank train{packed}")


def _image_path(model: torch.nn.Module, cfg: Any, groups: Any, on_gpu: bool) -> Optional[str]:
    """model.vision: the tower and the projector train or stay as loaded (after the adapters, which freeze every
    base weight: the projector then trains in full beside them)."""
    if cfg.model.image_path is None:
        return None
    from rayspeed.model.parts.image_input import ImageTextInput

    v = cfg.model.vision
    stages = [m for m in model.modules() if isinstance(m, ImageTextInput)]
    for stage in stages:
        for part, train in ((stage.tower, v.train_tower), (stage.projector, v.train_projector)):
            for p in part.parameters():
                p.requires_grad_(train)
    if not stages:
        return None
    return f"tower {'trains' if v.train_tower else 'frozen'}, projector {'trains' if v.train_projector else 'frozen'}"


def compile_decision(cfg: Any, on_gpu: bool) -> tuple[bool, str]:
    """(compile?, why). torch.compile runs on the model *before* deepspeed.initialize: that keeps part of the
    compile gain under DeepSpeed (H200 anchor: 124M ZeRO-1 71.3 ms compiled first vs 75.8 ms eager), where
    engine.compile() loses most of it.

    Source, first found: the environment variable RAYSPEED_COMPILE (1/0: an operator's override, used by
    scripts/bench_gpu.py), then train.compile (true / false / auto; absent: false). auto compiles on GPUs for
    the layouts it is known to work with (no pipeline, ZeRO 0-2, no tensor parallelism) and falls back to eager
    on a compile error; CPU jobs stay eager (their models are tiny and the compile costs more than it saves).
    """
    par = cfg.parallel
    env = os.environ.get("RAYSPEED_COMPILE", "").strip().lower()
    setting: Any = getattr(cfg.train, "compile", False)
    source = "train.compile"
    if env:
        setting, source = env in ("1", "true", "yes", "on"), "RAYSPEED_COMPILE"
    if par.pp > 1:
        return False, f"{source}={setting}: not compiled (pipeline stages run under DeepSpeed's pipeline engine)"
    if par.zero_stage == 3:
        return False, f"{source}={setting}: not compiled (ZeRO-3 gathers parameters inside the forward)"
    if setting == "auto":
        if not on_gpu:
            return False, "train.compile=auto: eager on CPU"
        if par.tp > 1:
            return False, "train.compile=auto: eager with tensor parallelism (collectives inside the layers)"
        return True, "train.compile=auto: compiled on GPU"
    return bool(setting), f"{source}={setting}"


def compile_model(model: torch.nn.Module, fallback_to_eager: bool) -> None:
    """Compile the module in place (nn.Module.compile: parameter names and state_dict keys stay the same, so
    checkpoints and exported models are interchangeable with eager runs)."""
    if fallback_to_eager:
        from rayspeed import compat

        compat.compile_errors_fall_back_to_eager()
    model.compile()


def _compile(model: torch.nn.Module, cfg: Any, groups: Any, on_gpu: bool) -> Optional[str]:
    do_compile, why = compile_decision(cfg, on_gpu)
    if not do_compile:
        log.debug("torch.compile off: %s", why)
        return None
    compile_model(model, fallback_to_eager=True)
    return why


ORDER = (
    Transform("tensor_parallel", "each rank holds its slice of the column/row-parallel weights and the vocabulary "
              "(consolidation concatenates them on the family record's tp dims)", at_build=_tensor_parallel),
    Transform("expert_parallel", "each rank holds its experts' rows of the stacks (layers.{i}.mlp.w_gate / w_up / "
              "w_down, a slice along the experts; consolidation concatenates the ep ranks')", apply=_expert_parallel),
    Transform("pipeline_split", "each stage holds its layers under their global names (layers.{i}.*)",
              at_build=_pipeline_split),
    Transform("router_freeze", "none", apply=_router_freeze),
    Transform("adapters", "adapter weights beside the frozen base names (<layer>.adapter.lora_A / lora_B / "
              "magnitude)", apply=_adapters),
    Transform("image_path", "none (a frozen tower keeps its names)", apply=_image_path),
    Transform("context_parallel", "slot: none (attention over a sequence split)"),
    Transform("activation_checkpointing", "none", apply=_activation_checkpointing),
    Transform("compile", "none (nn.Module.compile keeps parameter names)", apply=_compile),
)


def apply_transforms(model: torch.nn.Module, cfg: Any, groups: Any, on_gpu: bool) -> list[tuple[str, str]]:
    """Apply every transform of ORDER that concerns this job, in order; returns what each did."""
    done: list[tuple[str, str]] = []
    for t in ORDER:
        what = t.at_build(cfg) if t.at_build is not None else t.apply(model, cfg, groups, on_gpu) if t.apply else None
        if what:
            done.append((t.name, what + (" (at build)" if t.at_build is not None else "")))
    log_rank(log, "model transforms: %s", "; ".join(f"{n}: {w}" for n, w in done) or "none")  # the same on every rank
    return done
