"""Build the planning context from a job, enumerate every valid layout, evaluate and rank them."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from rayspeed.config.context_split import cp_candidates, cp_problem, scheme_for
from rayspeed.config.layout import CHECKPOINT_MODES, LAYOUT_KEYS, Layout
from rayspeed.config.schema import AUTO, JobConfig
from rayspeed.config.shape import ModelShape
from rayspeed.config.validate import default_sequence_parallel, sequence_parallel_problem, shape_split_problems
from rayspeed.errors import ConfigError
from rayspeed.planner import hardware, hwprofile
from rayspeed.planner.adapter_terms import AdapterPlan
from rayspeed.planner.dpo_terms import DpoPlan, reference_pass_s
from rayspeed.planner.ep_terms import ep_degrees, ep_problem
from rayspeed.planner.grpo_terms import GrpoPlan, cache_bytes, rollout_s
from rayspeed.planner.image_terms import ImagePlan, images_per_micro_batch
from rayspeed.planner.inputs import Ctx
from rayspeed.planner.margin import margin_bytes
from rayspeed.planner.memory import buckets, to_gib, worst_stage
from rayspeed.planner.partition import choose_split
from rayspeed.planner.timing import StepTime, step_time

GIB = hardware.GIB


# ---------------------------------------------------------------- context


def build_ctx(cfg: JobConfig, world_size: int | None = None, hardware_overrides: dict | None = None,
              profile=None, oom: Any = None) -> Ctx:
    """The planning context. `profile`: a hardware-profile path or dict (else `cluster.profile`); `oom`: OomFeedback."""
    c, t = cfg.cluster, cfg.train
    notes: list[str] = []
    world = int(world_size) if world_size else c.max_workers
    if world < 1:
        raise ConfigError(f"world size must be >= 1, got {world}")
    src = profile if profile is not None else getattr(c, "profile", None)
    prof = hwprofile.load(src) if src not in (None, "") else None
    gpu = c.gpu
    if gpu == AUTO and prof is not None and prof.gpu in hardware.TABLE and (prof.gpu == "cpu") == (not c.use_gpu):
        gpu = prof.gpu
    if gpu == AUTO:
        gpu = "h100-sxm-80gb" if c.use_gpu else "cpu"
        if c.use_gpu:
            notes.append("cluster.gpu is auto: planned for h100-sxm-80gb (assumed; the engine detects the real GPU "
                         "at run time and re-plans)")
    if gpu not in hardware.TABLE:
        raise ConfigError(f"cluster.gpu: unknown '{gpu}'; known: {', '.join(hardware.NAMES)} (or auto)")
    if c.use_gpu and gpu == "cpu":
        raise ConfigError("cluster.gpu: cpu contradicts cluster.use_gpu: true; set a GPU type or auto")
    if not c.use_gpu and gpu != "cpu":
        notes.append(f"cluster.use_gpu is false but cluster.gpu is {gpu}: planned for {gpu} GPUs")
    if prof is not None:
        hwprofile.check_device(prof, gpu)
    overrides = dict(hardware_overrides or getattr(c, "hardware", None) or {})
    try:
        hw = hardware.get(gpu, overrides)
    except KeyError as e:
        raise ConfigError(f"cluster.hardware: {e.args[0]}") from None
    if prof is not None:  # precedence: the measured profile > the job's overrides > the table
        hw = prof.apply(hw)
        notes.append(prof.describe())
        if prof.hardware.get("memory_gib"):
            overrides["memory_gib"] = prof.hardware["memory_gib"]
    if hw.is_gpu:
        node_size = c.gpus_per_node
    else:  # CPU workers: one node unless the job says there are several
        node_size = world if c.num_nodes <= 1 else -(-world // c.num_nodes)
    memory = hw.memory_gib
    if not hw.is_gpu and "memory_gib" not in overrides:
        memory = hardware.cpu_memory_gib(min(node_size, world))
        notes.append(f"cpu workers: memory budget {memory:.1f} GiB each (half the host RAM, split across "
                     f"{min(node_size, world)} workers)")
    precision = t.precision
    if precision == AUTO:
        precision = "fp32" if not hw.is_gpu else ("bf16" if hw.bf16 else "fp16")
    elif precision == "bf16" and hw.is_gpu and not hw.bf16:
        raise ConfigError(f"train.precision: bf16 is not supported on {hw.name}; use fp16 or auto")
    extra = {**(prof.ctx_fields() if prof is not None else {}), "image": ImagePlan.of(cfg)}
    shape = ModelShape.from_config(cfg.model)
    return Ctx(shape=shape, hw=hw, precision=precision, grad_accum_dtype=t.grad_accum_dtype,
               world=world, node_size=max(1, node_size), global_batch=t.global_batch_size, memory_gib=memory,
               notes=tuple(notes), document_masking=bool(getattr(cfg.data, "document_masking", False)),
               cp_scheme=str(getattr(cfg.parallel, "cp_scheme", AUTO)),
               adapter=AdapterPlan.of(cfg.model.adapter, shape), dpo=DpoPlan.of(cfg),
               rows_per_sample=2 if t.objective == "dpo" else 1, oom=oom, grpo=GrpoPlan.of(cfg), **extra)


# ---------------------------------------------------------------- constraints


def accumulation_cap(ctx: Ctx) -> int:
    """Field guide rule 4: max_grad_accum = floor(2048 / (params_in_billions * gpus^0.33)), at least 1. A hypothesis
    the model tests (planner/hypotheses.py), not a filter."""
    billions = ctx.shape.params / 1e9
    return max(1, math.floor(2048 / (billions * ctx.world**0.33)))


def beyond_cap(ctx: Ctx, lay: Layout) -> bool:
    return lay.grad_accum > accumulation_cap(ctx)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def fixed_keys(cfg: JobConfig) -> dict:
    par = cfg.parallel
    out = {k: getattr(par, k) for k in LAYOUT_KEYS if getattr(par, k) != AUTO}
    if getattr(cfg.train, "objective", "sft") == "grpo":  # sampling is built for data parallelism alone
        out.update({k: 1 for k in ("tp", "pp", "cp") if k not in out})
    if getattr(cfg.model, "image_path", None) is not None:  # the images enter whole on one stage, one rank's chunk
        out.update({k: 1 for k in ("pp", "cp") if k not in out})
    split = getattr(par, "stage_layers", None)
    if split:
        out["stage_layers"] = tuple(int(n) for n in split)
    return out


def tp_ok(ctx: Ctx, tp: int) -> str | None:
    sh = ctx.shape
    if sh.num_heads % tp or sh.num_kv_heads % tp:
        return f"tp {tp} does not divide model.num_heads ({sh.num_heads}) and model.num_kv_heads ({sh.num_kv_heads})"
    if sh.vocab_size % tp:
        return f"tp {tp} does not divide model.vocab_size ({sh.vocab_size}) (vocab-parallel embedding)"
    split = shape_split_problems(sh, tp, sequence_parallel=False)  # the model builder's own rules
    if split:
        return f"the model builder: {'; '.join(split)}"
    if tp > ctx.node_size:
        return f"tp {tp} exceeds the {ctx.node_size} ranks of a node (tp never spans nodes)"
    return None


def zero_problem(ctx: Ctx, zero: int) -> str | None:
    """DeepSpeed 0.19.8 has no ZeRO-0 path for half-precision weights whose gradients accumulate in another dtype:
    its engine raises "unsupported mix of model_dtype=torch.bfloat16 and grad_accum_dtype=torch.float32" at
    initialize (checked; `_do_optimizer_sanity_check`); from ZeRO-1 on its ZeRO or BF16 optimizer keeps them."""
    if zero == 0 and ctx.precision in ("bf16", "fp16") and ctx.grad_accum_dtype != ctx.precision:
        alt = " or train.grad_accum_dtype bf16" if ctx.precision == "bf16" else ""
        return (f"parallel.zero_stage 0 with train.precision {ctx.precision} and train.grad_accum_dtype "
                f"{ctx.grad_accum_dtype}: DeepSpeed has no ZeRO-0 path for half-precision weights whose gradients "
                "accumulate in another dtype; use parallel.zero_stage 1 (the same weights and gradients per rank, "
                f"the optimizer state divided){alt}")
    if zero == 3 and ctx.grpo is not None:
        return "parallel.zero_stage 3 with train.objective grpo: the rollouts would gather every layer per token"
    if zero == 3 and ctx.adapter is not None and ctx.adapter.dora:
        return "parallel.zero_stage 3 with model.adapter.dora: DoRA reads each whole base weight every forward"
    if zero == 3 and ctx.adapter is not None and ctx.adapter.nf4:
        return "parallel.zero_stage 3 with model.adapter.base_precision nf4: ZeRO-3 does not partition 4-bit weights"
    return None


def hpz_applies(ctx: Ctx, tp: int, dp: int) -> bool:
    """Field guide rule 2 (64+ GPUs: hierarchical all-gather) made real: ZeRO++ hierarchical partitioning,
    worth it only when the dp group spans nodes and has several ranks in each."""
    return ctx.hw.is_gpu and ctx.world > 64 and tp * dp > ctx.node_size and ctx.node_size // tp > 1


@dataclass
class Enumeration:
    layouts: list[Layout] = field(default_factory=list)  # every valid layout, above the accumulation cap too
    rejected: list[str] = field(default_factory=list)  # why structural combinations were dropped


def enumerate_layouts(ctx: Ctx, fixed: dict) -> Enumeration:
    """Every layout that satisfies the structural rules and the fixed keys."""
    sh, W, B = ctx.shape, ctx.world, ctx.global_batch
    out = Enumeration()
    tps = [fixed["tp"]] if "tp" in fixed else divisors(W)
    for tp in tps:
        if W % tp:
            out.rejected.append(f"parallel.tp ({tp}) does not divide the world size ({W})")
            continue
        why = tp_ok(ctx, tp)
        if why:
            if "tp" in fixed:
                out.rejected.append(f"parallel.tp: {why}")
            continue
        room = W // tp
        cps = [fixed["cp"]] if "cp" in fixed else cp_candidates(sh, room)
        for cp in cps:
            if room % cp:
                out.rejected.append(f"parallel.tp ({tp}) x parallel.cp ({cp}) = {tp * cp} does not divide the world "
                                    f"size ({W})")
                continue
            why = cp_problem(sh.seq_len, sh.num_heads, sh.num_kv_heads, tp, cp,
                             scheme_for(sh.num_heads, sh.num_kv_heads, tp, cp, ctx.cp_scheme))
            if why:
                out.rejected.append(why)
                continue
            split = fixed.get("stage_layers")
            pps = [fixed["pp"]] if "pp" in fixed else ([len(split)] if split else divisors(room // cp))
            for pp in pps:
                if (room // cp) % pp:
                    out.rejected.append(f"parallel.tp ({tp}) x parallel.cp ({cp}) x parallel.pp ({pp}) = "
                                        f"{tp * cp * pp} does not divide the world size ({W})")
                    continue
                if sh.num_experts and pp > 1 and max(cp, tp) > 1:  # not built yet (config/moe_keys.py says why)
                    continue
                dp = W // (tp * cp * pp)
                eps = ep_degrees(sh, dp, fixed)
                if sh.num_experts and cp > 1:  # experts over ep beside cp: not built yet (config/moe_keys.py)
                    eps = [e for e in eps if e == 1]
                bad_ep = [why for why in (ep_problem(sh, dp, e) for e in eps) if why]
                if bad_ep:
                    out.rejected.extend(bad_ep)
                    continue
                if pp > sh.num_layers:  # any pp up to the layer count: stages may hold unequal numbers of blocks
                    if "pp" in fixed:
                        out.rejected.append(f"parallel.pp ({pp}) exceeds model.num_layers ({sh.num_layers}): "
                                            "every stage needs at least one layer")
                    continue
                if split and (len(split) != pp or sum(split) != sh.num_layers):
                    out.rejected.append(f"parallel.stage_layers {list(split)} must give pp ({pp}) stages adding up to "
                                        f"model.num_layers ({sh.num_layers})")
                    continue
                if "dp" in fixed and fixed["dp"] != dp:
                    out.rejected.append(f"parallel.dp ({fixed['dp']}) x cp ({cp}) x tp ({tp}) x pp ({pp}) "
                                        f"must equal the world size ({W}); dp would be {dp}")
                    continue
                if "micro_batch_size" in fixed and B % (dp * fixed["micro_batch_size"]):
                    mb = fixed["micro_batch_size"]
                    fits = [m for m in divisors(B // dp)] if B % dp == 0 else []
                    out.rejected.append(f"train.global_batch_size ({B}) is not divisible by dp ({dp}) x "
                                        f"parallel.micro_batch_size ({mb}) = {dp * mb}; "
                                        + (f"use a micro-batch in {fits} or " if fits else "")
                                        + f"a global batch that is a multiple of {dp * mb}"
                                        + ("" if fits else " (or a world size that divides it)"))
                    continue
                if B % dp:
                    out.rejected.append(f"train.global_batch_size ({B}) is not divisible by dp ({dp}) "
                                        f"(= {W} workers / (tp {tp} x cp {cp} x pp {pp})): use a global batch that is "
                                        "a multiple "
                                        f"of {dp}, or a world size that divides {B}")
                    continue
                per = B // dp
                mbs = [fixed["micro_batch_size"]] if "micro_batch_size" in fixed else divisors(per)
                for mb in mbs:
                    if per % mb:
                        out.rejected.append(f"train.global_batch_size ({B}) is not divisible by dp ({dp}) x "
                                            f"parallel.micro_batch_size ({mb}); use a micro-batch that divides {per}")
                        continue
                    ga = per // mb
                    if "grad_accum" in fixed and fixed["grad_accum"] != ga:
                        out.rejected.append(f"train.global_batch_size ({B}) != dp ({dp}) x "
                                            f"parallel.micro_batch_size ({mb}) x parallel.grad_accum "
                                            f"({fixed['grad_accum']}); grad_accum would be {ga}")
                        continue
                    zeros = [fixed["zero_stage"]] if "zero_stage" in fixed else ([0, 1] if pp > 1 else [0, 1, 2, 3])
                    for z in zeros:
                        if pp > 1 and z > 1:
                            out.rejected.append(f"parallel.zero_stage ({z}) with pp {pp}: DeepSpeed's pipeline engine "
                                                "supports ZeRO 0 or 1 only")
                            continue
                        why = zero_problem(ctx, z)
                        if why:
                            out.rejected.append(why)
                            continue
                        sps = ([fixed["sequence_parallel"]] if "sequence_parallel" in fixed
                               else [default_sequence_parallel(sh.seq_len // cp, tp)])
                        for sp in sps:
                            if sp and tp == 1:
                                out.rejected.append("parallel.sequence_parallel: true needs tp > 1")
                                continue
                            if sp and sequence_parallel_problem(sh.seq_len // cp, tp):
                                out.rejected.append(f"parallel.sequence_parallel: true needs the tokens per cp rank "
                                                    f"({sh.seq_len // cp}) divisible by tp ({tp})")
                                continue
                            modes = ([fixed["activation_checkpointing"]] if "activation_checkpointing" in fixed
                                     else list(CHECKPOINT_MODES))
                            hpzs = [1]
                            if z == 3 and cp == 1 and hpz_applies(ctx, tp, dp):
                                hpzs.append(max(1, min(dp, ctx.node_size // tp)))
                            for ac, hpz, ep in itertools.product(modes, hpzs, eps):
                                if ep > 1 and ((tp > 1 and z == 3) or pp > 1):  # config/moe_keys.py says why
                                    continue
                                out.layouts.append(Layout(dp, tp, pp, z, mb, ga, bool(sp), ac, hpz,
                                                          stage_layers=split if (split and pp > 1) else None,
                                                          cp=cp, ep=ep))
    return out


# ---------------------------------------------------------------- evaluation


@dataclass
class Estimate:
    layout: Layout
    fits: bool
    memory: dict  # bytes by component, worst stage
    worst_stage: int
    ctx: Ctx
    refused: Any = None  # the planner.oom_feedback.MeasuredOom of a layout that ran out of memory

    @functools.cached_property
    def time(self) -> StepTime:
        """Computed on first use: most candidates of a big search never fit and are never timed."""
        return step_time(self.ctx, self.layout)

    @functools.cached_property
    def memory_gib(self) -> float:
        return sum(self.memory.values()) / GIB

    @functools.cached_property
    def margin_gib(self) -> float:
        """The memory model's uncertainty about this estimate (planner/margin.py)."""
        return margin_bytes(self.memory) / GIB

    @property
    def safe(self) -> bool:
        """Fits with the margin: what the pick must do whenever any layout does."""
        return self.memory_gib + self.margin_gib <= self.ctx.usable_gib

    def memory_text(self) -> str:
        return f"{self.memory_gib:.1f} GiB +- {self.margin_gib:.1f}"

    @property
    def step_s(self) -> float:
        return self.time.step_s

    @property
    def tokens_per_s_per_gpu(self) -> float:
        rows = self.ctx.global_batch * self.ctx.rows_per_sample  # a DPO pair is two sequences
        return rows * self.ctx.shape.seq_len / self.step_s / self.ctx.world

    @property
    def mfu(self) -> float:
        hw = self.ctx.hw
        flops = self.ctx.adapter.flops_per_token if self.ctx.adapter else self.ctx.shape.flops_per_token
        return self.tokens_per_s_per_gpu * flops / hw.peak(self.ctx.precision)

    def overshoot_gib(self) -> float:
        return self.memory_gib - self.ctx.usable_gib

    def biggest_part(self) -> tuple[str, float]:
        k = max(self.memory, key=self.memory.__getitem__)
        return k, self.memory[k] / GIB

    def to_plan(self) -> dict:
        """The plan object of the interface: layout fields + fits, memory, time, throughput."""
        d = self.layout.as_dict()
        d.update(
            fits=self.fits,
            memory_gib_per_gpu=round(self.memory_gib, 3),
            memory_margin_gib=round(self.margin_gib, 3),
            memory_range_gib=[round(self.memory_gib - self.margin_gib, 3), round(self.memory_gib + self.margin_gib, 3)],
            fits_with_margin=self.safe,
            memory_breakdown_gib=to_gib(self.memory),
            # Exact model-state bytes of the worst rank, for checking against the real engine.
            model_state_bytes={k: int(self.memory.get(k, 0))
                               for k in ("weights", "gradients", "master_weights", "optimizer_states")},
            usable_memory_gib=round(self.ctx.usable_gib, 3),
            worst_stage=self.worst_stage,
            step_time_s=round(self.step_s, 6),
            tokens_per_s_per_gpu=round(self.tokens_per_s_per_gpu, 2),
            mfu=round(self.mfu, 4),
            time_breakdown_s=self.time.as_dict(),
        )
        if self.ctx.dpo is not None and self.ctx.dpo.reference == "precomputed":
            d["dpo_reference_pass_s_per_1000_pairs"] = round(reference_pass_s(self.ctx, self.layout), 3)
        if self.ctx.grpo is not None:
            d["grpo_rollout"] = {"completions_per_rank": self.ctx.global_batch // self.layout.dp,
                                 "kv_cache_gib": round(cache_bytes(self.ctx, self.layout) / GIB, 4),
                                 "sampling_s": round(rollout_s(self.ctx, self.layout), 4)}
        if self.ctx.image is not None:
            im = self.ctx.image
            d["images"] = {"tokens_per_image": im.image_tokens, "at_most_per_micro_batch":
                           images_per_micro_batch(self.ctx, self.layout), "cached_bytes_per_image": im.pixel_bytes,
                           "tower_parameters": im.tower_params, "projector_parameters": im.projector_params}
        if self.refused is not None:
            m = self.refused
            d["reason"] = (f"ran out of memory at step {m.step} on rank {m.rank} (needed at least "
                           f"{m.need_bytes / GIB:.2f} GiB; predicted {m.predicted_bytes / GIB:.2f} GiB)")
        elif not self.fits:
            k, v = self.biggest_part()
            d["reason"] = (f"needs {self.memory_gib:.2f} GiB on the worst rank (stage {self.worst_stage}) but "
                           f"{self.ctx.usable_gib:.2f} GiB are usable (over by {self.overshoot_gib():.2f} GiB; "
                           f"largest part: {k} {v:.2f} GiB)")
        return d


def evaluate(ctx: Ctx, lay: Layout, cache: dict | None = None) -> Estimate:
    """Memory and (lazily) time of one layout; a pipeline without an explicit split gets the planner's.
    `cache`: splits already chosen in this search (they depend on tp, pp, micro-batch, sp and checkpointing)."""
    if lay.pp > 1 and lay.stage_layers is None:
        key = (lay.tp, lay.cp, lay.pp, lay.micro_batch_size, lay.sequence_parallel, lay.activation_checkpointing,
               lay.zero_stage)
        split = cache.get(key) if cache is not None else None
        if split is None:
            split = choose_split(ctx, lay)
            if cache is not None:
                cache[key] = split
        lay = dataclasses.replace(lay, stage_layers=split)
    stage, mem = worst_stage(ctx, lay)
    refused = None
    if ctx.oom:
        extra, refused = ctx.oom.extra_bytes(lay, mem), ctx.oom.refused(lay)
        if extra:
            mem = {**mem, "measured_oom": extra}
    tot = sum(mem.values()) / GIB
    return Estimate(layout=lay, fits=tot <= ctx.usable_gib and refused is None, memory=mem, worst_stage=stage,
                    ctx=ctx, refused=refused)


def deepspeed_options(ctx: Ctx, lay: Layout) -> dict:
    """The DeepSpeed settings this plan's estimates assume, flat (the engine reads these keys from
    plan["deepspeed"]): bucket sizes, ZeRO-3 prefetch/persistence/live limits, ZeRO++ hpZ."""
    b = buckets(ctx, lay)
    out = {"reduce_bucket_size": b["reduce_bucket_size"], "allgather_bucket_size": b["allgather_bucket_size"],
           "overlap_comm": ctx.hw.is_gpu, "contiguous_gradients": True, "communication_data_type": "fp32"}
    if lay.zero_stage == 3:
        out.update({k: b[k] for k in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                                      "stage3_max_live_parameters", "stage3_max_reuse_distance")})
        if lay.hpz > 1:
            out["zero_hpz_partition_size"] = lay.hpz
    return out
