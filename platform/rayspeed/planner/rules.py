"""The field guide's rules of thumb (PLAYBOOK.md part B), each computed for this job and shown beside the
plan. Where a rule names a mechanism that does not exist, the rule's intent is served by one that does,
and the rule says so."""

from __future__ import annotations

import math
from collections.abc import Callable

from rayspeed.config.layout import Layout
from rayspeed.planner.hypotheses import STRATEGY_RULE, RuleTest, check_nccl_tree, check_strategy
from rayspeed.planner.inputs import Ctx
from rayspeed.planner.search import Estimate

# ---------------------------------------------------------------- 1. strategy by size


def strategy_family(ctx: Ctx) -> tuple[str, Callable[[Layout], bool]]:
    """(name, predicate on a layout) of the strategy the size rule recommends."""
    b = ctx.shape.params / 1e9
    if b < 10:
        return "pure data parallel (model < 10B)", lambda l: l.tp == 1 and l.pp == 1
    if b <= 100:
        if ctx.world < 32:
            return "pipeline parallel with 2 stages (10-100B, < 32 GPUs)", lambda l: l.pp == 2 and l.tp == 1
        return "data + tensor parallel, 2D (10-100B, >= 32 GPUs)", lambda l: l.tp > 1 and l.pp == 1
    return "3D: data x pipeline x tensor (> 100B)", lambda l: l.tp > 1 and l.pp > 1


def strategy_rule(ctx: Ctx, best: Estimate | None, ranked: list[Estimate], all_est: list[Estimate]) -> dict:
    name, pred = strategy_family(ctx)
    out = {"rule": STRATEGY_RULE, "params_billions": round(ctx.shape.params / 1e9, 3), "gpus": ctx.world,
           "recommends": name,
           "fits": any(pred(e.layout) for e in ranked),
           "chosen_follows_rule": bool(best is not None and pred(best.layout))}
    if best is not None:
        t = check_strategy(ctx, best, ranked, all_est, name, pred)
        out.update(applied=t.applied, note=t.why, **{k: v for k, v in t.numbers.items() if k != "recommends"})
        if "rule_best" in t.numbers:
            out["rule_best_layout"] = t.numbers["rule_best"]["layout"]
    return out


# ---------------------------------------------------------------- 3. learning rate


# Peak learning rates of published pretraining recipes for 1B-70B decoders (docs/PLANNER.md cites each): LLaMA and
# Llama 2 3e-4 at 7B-13B, 1.5e-4 at 33B-70B; OLMo 1B 4e-4, 7B 3e-4; Pythia 1B 3e-4, 1.4B 2e-4, 2.8B 1.6e-4. The
# field guide's rule is kept visible; a value outside this band for a model in this size band is warned about,
# never changed.
PUBLISHED_LR_BAND = (1.5e-4, 6e-4)
PUBLISHED_LR_PARAMS = (0.9e9, 80e9)


def lr_rule(global_batch: int, gpus: int, params: int | None = None) -> dict:
    """base = 1e-4 * sqrt(B / 1024); lr = base * min(1, log2(gpus) / 7). As written it is 0 on one GPU:
    the GPU factor is floored at 1/7 (log2 taken as at least 1, i.e. the 2-GPU value). With the model's parameter
    count, a value outside the published recipes' band for 1B-70B models carries a one-line warning."""
    base = 1e-4 * math.sqrt(global_batch / 1024)
    raw = min(1.0, math.log2(gpus) / 7) if gpus >= 1 else 0.0
    factor = min(1.0, max(1.0, math.log2(max(gpus, 1))) / 7)
    lr = base * factor
    out = {
        "rule": "lr = 1e-4 * sqrt(global_batch / 1024) * min(1, log2(gpus) / 7)",
        "global_batch": global_batch,
        "gpus": gpus,
        "base": base,
        "gpu_factor": factor,
        "lr": lr,
    }
    if factor != raw:
        out["floored"] = (f"log2({gpus})/7 = {raw:.3f} would give lr {base * raw:.3g}; the factor is floored at 1/7 "
                          "(log2 taken as at least 1), so lr is never 0")
    lo, hi = PUBLISHED_LR_BAND
    if params is not None and PUBLISHED_LR_PARAMS[0] <= params <= PUBLISHED_LR_PARAMS[1] and not lo <= lr <= hi:
        out["warning"] = (f"lr: auto gives {lr:.2g} for a {params / 1e9:.1f}B model, outside the {lo:.1e}-{hi:.0e} "
                          "that published recipes use at 1B-70B (LLaMA, Llama 2, OLMo, Pythia; docs/PLANNER.md); "
                          "set train.lr to override the field guide's rule")
    return out


# ---------------------------------------------------------------- 2. communication by cluster size


def comm_profile(ctx: Ctx, lay: Layout, collective_timeout_s: float | None = None,
                 tree: RuleTest | None = None) -> dict:
    """The communication settings for this cluster size. The field guide's NCCL_ALGO=Tree (9-64 GPUs) is a
    hypothesis: set only when the time model, predicting every all-reduce of the job as a tree, finds the step
    faster (`tree`: that test, made here when not given)."""
    n = ctx.world
    env: dict[str, str] = {}
    ds: dict = {}
    notes: list[str] = []
    if not ctx.hw.is_gpu:
        return {"gpus": n, "tier": "cpu (gloo)", "backend": "gloo", "env": {}, "deepspeed": {},
                "notes": ["CPU workers use gloo over the host network; the NCCL tiers of the rule do not apply"]}
    if n <= 8:
        tier = "1-8 GPUs: plain all-reduce (NCCL defaults over NVLink)"
    elif n <= 64:
        tier = "8-64 GPUs: NCCL tree algorithm (tested by the time model)"
        tree = tree or check_nccl_tree(ctx, lay)
        if tree.applied:
            env["NCCL_ALGO"] = "Tree"
        notes.append(f"NCCL_ALGO=Tree {tree.why}")
    elif n <= 256:
        tier = "64-256 GPUs: hierarchical all-gather (within nodes, then across)"
    else:
        tier = "> 256 GPUs: topology-aware mixed strategy"
        notes.append("NCCL_ALGO left to NCCL's tuner: trees for small messages, rings for large ones")
        env["NCCL_CROSS_NIC"] = "0"  # keep each ring/tree on its rail (rail-optimised fabrics)
    if n > 64:
        if lay.hpz > 1:
            ds["zero_hpz_partition_size"] = lay.hpz
            notes.append(f"ZeRO++ hierarchical partitioning: a secondary weight partition per node "
                         f"(zero_hpz_partition_size={lay.hpz}) keeps backward all-gathers on NVLink")
        elif lay.zero_stage != 3:
            notes.append(f"hierarchical partitioning (ZeRO++ zero_hpz_partition_size) applies to ZeRO-3 only; with "
                         f"ZeRO-{lay.zero_stage} NCCL's topology-aware rings already reduce inside a node before "
                         "crossing it")
    if n > 128:
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
        notes.append("asynchronous NCCL error handling on (> 128 GPUs): a dead rank fails the job instead of hanging "
                     "it (NCCL_ASYNC_ERROR_HANDLING is the deprecated alias)")
    if collective_timeout_s:
        notes.append(f"collective timeout = process-group timeout {collective_timeout_s:.0f} s "
                     "(resilience.collective_timeout_s; there is no NCCL_SOCKET_TIMEOUT variable)")
    out = {"gpus": n, "tier": tier, "backend": "nccl", "env": env, "deepspeed": ds, "notes": notes}
    if tree is not None:
        out["nccl_algo_test"] = tree.as_dict()
    return out


# ---------------------------------------------------------------- 6. precision


def precision_rule(ctx: Ctx, requested: str) -> dict:
    hw = ctx.hw
    out: dict[str, object] = {"precision": ctx.precision, "requested": requested}
    if requested == "auto":
        out["why"] = ("fp32 on CPU workers" if not hw.is_gpu else
                      "bf16: the GPU supports it (prefer bf16)" if hw.bf16 else "fp16: the GPU has no bf16")
    else:
        out["why"] = "set in the job file"
    out["tf32"] = bool(hw.is_gpu and hw.tf32)
    if out["tf32"]:
        out["torch_flags"] = {"torch.backends.cuda.matmul.allow_tf32": True, "torch.backends.cudnn.allow_tf32": True}
    if ctx.precision == "fp16" and ctx.global_batch > 1024:
        out["warning"] = ("fp16 with a global batch > 1024 is where gradient-sync errors were seen: prefer bf16; "
                          "gradients are reduced in fp32 (DeepSpeed communication_data_type)")
    return out


# ---------------------------------------------------------------- 5. activation checkpointing


def checkpointing_template(ctx: Ctx, lay: Layout) -> dict:
    """What recomputation the runtime really applies (rayspeed.model.parts.blocks.Block): torch.utils.checkpoint,
    non-reentrant, per block or per sub-block. DeepSpeed's activation-checkpointing options (partitioned activations,
    contiguous buffers, CPU checkpointing) act only through deepspeed.checkpointing.checkpoint, which this model does
    not call, so they are neither set nor claimed."""
    what = {"none": "nothing recomputed", "selective": "attention and MLP sub-blocks recomputed in backward",
            "full": "whole transformer blocks recomputed in backward"}[lay.activation_checkpointing]
    return {
        "mode": lay.activation_checkpointing,
        "template": f"{what} (torch.utils.checkpoint, non-reentrant, RNG state not preserved)",
        "preserve_rng_state": False,  # the model has no dropout
        "number_checkpoints": ((max(lay.stage_layers) if lay.stage_layers else ctx.shape.num_layers // lay.pp)
                               if lay.activation_checkpointing != "none" else 0),
        "not_applied": "DeepSpeed partition_activations / contiguous_memory_optimization / cpu_checkpointing "
                       "(they need deepspeed.checkpointing.checkpoint, which the model does not use)",
    }


# ---------------------------------------------------------------- 10. topology


def topology_rule(ctx: Ctx, lay: Layout) -> dict:
    n, k = ctx.world, ctx.node_size
    nodes = ctx.nodes
    per_node = n / nodes
    out = {
        "rule": "up to 8 GPUs on one node (full NVLink); beyond, spread evenly, >= 4 GPUs per node, symmetric; "
                "tp never spans nodes",
        "nodes": nodes,
        "ranks_per_node": k,
        "tp_within_node": lay.tp <= k,
        "symmetric": n % k == 0 or nodes == 1,
        "min_4_per_node": nodes == 1 or per_node >= 4,
        "placement_strategy": ("PACK" if nodes == 1
                               else "SPREAD across nodes, PACK within (ranks tp-fastest, then dp, then pp)"),
        "order": "tp innermost (NVLink), then dp, then pp across nodes",
    }
    if lay.pp > 1 and nodes > 1:
        out["pp_across_nodes"] = True
    return out


def all_rules(ctx: Ctx, lay: Layout, best: Estimate | None, ranked, all_est, requested_precision: str,
              collective_timeout_s: float | None, cap: RuleTest) -> dict:
    tree = check_nccl_tree(ctx, lay, best.step_s if best is not None else None) if 8 < ctx.world <= 64 else None
    return {
        "strategy": strategy_rule(ctx, best, ranked, all_est),
        "lr": lr_rule(ctx.global_batch, ctx.world, ctx.shape.params),
        "accumulation_cap": cap.as_dict(),
        "comm_profile": comm_profile(ctx, lay, collective_timeout_s, tree),
        "precision": precision_rule(ctx, requested_precision),
        "checkpointing": checkpointing_template(ctx, lay),
        "topology": topology_rule(ctx, lay),
    }
