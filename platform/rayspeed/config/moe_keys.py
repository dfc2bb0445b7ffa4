"""Mixture-of-experts keys: what a MoE family's config.json says about its experts, the MoE architectures rayspeed
refuses (and why), and what a job with experts may not combine yet. Torch-free."""

from __future__ import annotations

from typing import Any, Optional

from rayspeed.config.adapter import MLP_ROLES
from rayspeed.families import Family

# Model keys a MoE config.json decides (with the shape keys of config/hf_config.py).
MOE_SHAPE_KEYS = ("num_experts", "experts_per_token", "expert_ffn_hidden_size", "norm_topk_prob", "moe_layers")

# Architectures with experts that rayspeed does not run, and what it would need first.
UNSUPPORTED = {
    "DeepseekV2ForCausalLM": "DeepSeek-V2's softmax routing (its topk_method greedy or group_limited_greedy) is not "
                             "built (its latent attention is the one DeepSeek-V3's family runs)",
    "Qwen3NextForCausalLM": "Qwen3-Next's hybrid attention (Gated DeltaNet linear-attention layers between gated "
                            "full-attention ones) and its shared expert are not built",
    "Qwen2MoeForCausalLM": "Qwen2-MoE's shared expert with its sigmoid gate is not built",
}


def unsupported_reason(architecture: Optional[str]) -> Optional[str]:
    """Why rayspeed does not run this MoE architecture (None: not one it names)."""
    return UNSUPPORTED.get(str(architecture))


def moe_keys_from_hf(family: Family, hf: dict[str, Any], where: str, problems: list[str]) -> dict[str, Any]:
    """The expert keys of a config.json (num_experts 0 and nothing else for a dense family)."""
    keys: dict[str, Any] = {"num_experts": 0, "experts_per_token": 2, "expert_ffn_hidden_size": None,
                            "norm_topk_prob": True, "moe_layers": None}  # the model section's defaults: dense
    names = family.moe
    if names is None:
        return keys
    # transformers 5 writes either name for either family (its attribute_map): the hub's files use the family's.
    count = next((hf[k] for k in (names.experts, "num_experts", "num_local_experts") if hf.get(k) is not None), 0)
    experts, top_k = int(count or 0), int(hf.get("num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= top_k <= experts:
        problems.append(f"{where}: {names.experts} {experts} and num_experts_per_tok {top_k} are not a mixture of "
                        "experts (1 <= num_experts_per_tok <= experts)")
    if float(hf.get("router_jitter_noise") or 0.0):
        problems.append(f"{where}: router_jitter_noise {hf['router_jitter_noise']} is not supported (routing must be "
                        "a function of the weights and tokens); set it to 0")
    ffn = hf.get(names.expert_ffn) if names.expert_ffn else hf.get("intermediate_size")
    num_layers = int(hf["num_hidden_layers"])
    keys.update(num_experts=experts, experts_per_token=top_k, expert_ffn_hidden_size=int(ffn) if ffn else None,
                norm_topk_prob=bool(hf.get(names.norm_topk, family.defaults.get(names.norm_topk, False)))
                if names.norm_topk else True,
                moe_layers=names.moe_layers(hf, num_layers))
    return keys


def aux_coef_from_hf(family: Family, hf: dict[str, Any]) -> Optional[float]:
    """config.json's router_aux_loss_coef for a MoE family (when it is left out, the family's default: transformers'
    0.001, or 0 for a family whose transformers model adds no balance loss, DeepSeek-V3)."""
    if family.moe is None:
        return None
    value = hf.get("router_aux_loss_coef", family.defaults.get("router_aux_loss_coef"))
    return float(value) if value is not None else 0.001


def _layer_problems(family: Family, layers: Any, num_layers: int) -> list[str]:
    """model.moe_layers against the layers the family can make experts of."""
    keys = family.moe
    assert keys is not None  # a family with experts (moe_problems)
    if keys.first_dense is not None and layers:  # dense first layers, the rest experts
        if sorted(layers) != list(range(min(layers), num_layers)):
            return [f"model.moe_layers: a {family.architecture}'s dense layers are its first ones "
                    f"({keys.first_dense}); give the layers from one on to the last"]
    elif keys.sparse_step is None and layers is not None and sorted(layers) != list(range(num_layers)):
        return [f"model.moe_layers: every layer of a {family.architecture} is a mixture of experts; leave it null"]
    return []


def moe_problems(cfg: Any) -> list[str]:
    """A job's expert keys that do not make a mixture of experts, and what it cannot combine yet; each names the
    key and the fix."""
    model, par = cfg.model, cfg.parallel
    experts = int(getattr(model, "num_experts", 0) or 0)
    ep = getattr(par, "ep", 1)
    if isinstance(ep, int) and ep < 1:
        return [f"parallel.ep: must be >= 1 or auto, got {ep}"]
    if not experts:
        out = []
        if getattr(model, "freeze_router", False):
            out.append("model.freeze_router: true needs a mixture of experts (model.num_experts is 0); set "
                       "model.freeze_router: false")
        if ep not in (1, "auto"):
            out.append(f"parallel.ep: {ep} needs a mixture of experts (model.num_experts is 0); set parallel.ep: 1")
        return out
    from rayspeed import families

    family = families.find(model.architecture)
    if family is None or family.moe is None:
        moe = ", ".join(f.architecture for f in families.FAMILIES if f.moe is not None)
        return [f"model.num_experts: {experts} needs a family with experts ({moe}); model.architecture is "
                f"{model.architecture}: set model.num_experts: 0 or another architecture"]
    out = []
    if not 1 <= int(model.experts_per_token) <= experts:
        out.append(f"model.experts_per_token: {model.experts_per_token} must be between 1 and model.num_experts "
                   f"({experts})")
    layers = model.moe_layers
    if layers is not None and any(not 0 <= int(i) < model.num_layers for i in layers):
        out.append(f"model.moe_layers: {layers} names layers outside 0..{model.num_layers - 1}")
    out += _layer_problems(family, layers, model.num_layers)
    ffn = model.expert_ffn_hidden_size
    if family.moe.expert_ffn is None and ffn is not None and model.ffn_hidden_size not in (None, ffn):
        out.append(f"model.expert_ffn_hidden_size: a {family.architecture}'s experts are ffn_hidden_size wide "
                   f"({model.ffn_hidden_size}); leave it null")
    cp, pp, tp = getattr(par, "cp", 1), getattr(par, "pp", 1), getattr(par, "tp", 1)
    if tp not in (1, "auto") and pp not in (1, "auto"):
        out.append(f"parallel.pp: {pp} with parallel.tp: {tp} and a mixture of experts: DeepSpeed's pipeline "
                   "partitions what stages send under tp, and the balance statistics travel with the hidden states "
                   "(not built); set parallel.tp: 1 or parallel.pp: 1")
    if cp not in (1, "auto") and pp not in (1, "auto"):
        out.append(f"parallel.cp: {cp} with parallel.pp: {pp} and a mixture of experts: the pipeline stages do not "
                   "pool the balance statistics over the context-parallel ranks yet; set parallel.pp: 1 or "
                   "parallel.cp: 1")
    if cp not in (1, "auto") and ep not in (1, "auto"):
        out.append(f"parallel.ep: {ep} with parallel.cp: {cp}: experts split over the data-parallel ranks beside "
                   "context parallelism are not built yet; set parallel.ep: 1 (ZeRO shards the experts)")
    if ep not in (1, "auto"):
        if experts % int(ep):
            out.append(f"parallel.ep: {ep} must divide model.num_experts ({experts}); use a divisor of it")
        dp = getattr(par, "dp", "auto")
        if dp != "auto" and int(dp) % int(ep):
            out.append(f"parallel.ep: {ep} must divide parallel.dp ({dp}): experts are split over data-parallel "
                       "ranks")
        if getattr(par, "pp", 1) not in (1, "auto"):
            out.append(f"parallel.ep: {ep} with parallel.pp: {par.pp}: the pipeline engine does not take expert "
                       "parallelism yet; set parallel.pp: 1")
        tp = getattr(par, "tp", 1)
        if tp not in (1, "auto") and getattr(par, "zero_stage", "auto") == 3:
            out.append(f"parallel.ep: {ep} with parallel.tp: {tp} at parallel.zero_stage: 3: DeepSpeed's ZeRO-3 "
                       "gradient norm would count the tp shards every ep rank holds alike once per ep rank; use "
                       "zero_stage 1 or 2 (experts and their optimizer state are split over ep already)")
    adapter = model.adapter
    mlp = [r for r in MLP_ROLES if r in (getattr(adapter, "targets", None) or ())]
    if getattr(adapter, "type", "none") != "none" and mlp:
        out.append(f"model.adapter.targets: {', '.join(mlp)} on a mixture of experts: peft maps those roles onto the "
                   "experts' stacked weights, which rayspeed does not adapt (its MLPs stay frozen); target q, k, v, o "
                   "or all (the attention)")
    if getattr(adapter, "type", "none") != "none" and getattr(adapter, "base_precision", "auto") == "nf4":
        out.append("model.adapter.base_precision: nf4 on a mixture of experts: the experts' stacked weights are not "
                   "packed in 4 bits; use base_precision: auto (the experts stay frozen in the job's precision)")
    return out


SCORE_BIAS = "mlp.router.score_bias"  # a family's per-expert score correction (DeepSeek-V3's e_score_correction_bias)


def bias_update_problems(cfg: Any) -> list[str]:
    """model.router_bias_update against the family and the layout: a speed >= 0, a family whose router has a score
    correction, a layout where every rank holds the correction whole (not ZeRO-3's partitions)."""
    speed = getattr(cfg.model, "router_bias_update", 0.0)
    if not speed:
        return []
    if speed < 0:
        return [f"model.router_bias_update: must be >= 0 (0: off; DeepSeek-V3 trained with 0.001), got {speed}"]
    from rayspeed import families

    family = families.find(cfg.model.architecture)
    if family is None or SCORE_BIAS not in family.tensor_names.in_layer or not cfg.model.num_experts:
        return [f"model.router_bias_update: {cfg.model.architecture} routes without a score correction to move "
                "(DeepSeek-V3's e_score_correction_bias); set it to 0"]
    if cfg.parallel.zero_stage == 3:
        return ["model.router_bias_update: ZeRO-3 partitions the score corrections it moves in place; use "
                "parallel.zero_stage 0-2, or set it to 0"]
    return []


def expert_problems(cfg: Any) -> list[str]:
    """moe_problems and bias_update_problems."""
    return moe_problems(cfg) + bias_update_problems(cfg)
