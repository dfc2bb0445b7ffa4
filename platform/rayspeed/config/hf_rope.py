"""A Hugging Face config.json's RoPE settings, both forms: `rope_theta` + `rope_scaling` (transformers 4's; `type` or
`rope_type`) and `rope_parameters` (transformers 5, per layer type for a family with local layers). Pure Python."""

from __future__ import annotations

from typing import Any, Optional

from rayspeed.families import Family
from rayspeed.families.family import FULL_ATTENTION, LOCAL_ROPE_KEY, PARTIAL_ROTARY_KEY, SLIDING_ATTENTION


def local_rope(hf: dict[str, Any], family: Family, where: str, problems: list[str]) -> Optional[float]:
    """The sliding-window layers' RoPE base of a family that has one (plain RoPE only), from either form."""
    if not family.keys.reads(LOCAL_ROPE_KEY):
        return None
    params = hf.get("rope_parameters")
    local = params.get(SLIDING_ATTENTION) if isinstance(params, dict) else None
    if isinstance(local, dict):
        kind = str(local.get("rope_type", local.get("type", "default")))
        if kind != "default":
            problems.append(f"{where}: rope_parameters.{SLIDING_ATTENTION} has rope type {kind!r}; the local layers "
                            "are supported with plain RoPE only")
        return float(local.get("rope_theta", family.defaults["rope_local_base_freq"]))
    return float(hf.get("rope_local_base_freq", family.defaults["rope_local_base_freq"]))


def partial_rotary(hf: dict[str, Any]) -> Optional[float]:
    """The share of each head RoPE rotates, from rope_parameters (transformers 5) or the top level; None: all."""
    params = hf.get("rope_parameters")
    params = params.get(FULL_ATTENTION, params) if isinstance(params, dict) else {}
    value = (params or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    return None if value in (None, 1, 1.0) else float(value)


def rope_from_hf(hf: dict[str, Any], family: Family, where: str,
                 problems: list[str]) -> tuple[float, Optional[dict[str, Any]]]:
    """(rope_theta, rope_scaling or None) from either form; per layer type, those of the full-attention layers
    (the family's local RoPE is local_rope's)."""
    rope_types, default_theta = family.keys.rope_types, float(family.defaults.get("rope_theta", 10000.0))
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        if not family.keys.reads(LOCAL_ROPE_KEY) or FULL_ATTENTION not in params:
            problems.append(f"{where}: rope_parameters per layer type ({', '.join(params)}) are not supported for "
                            f"{family.architecture}; one RoPE for all layers is")
            return default_theta, None
        params = params[FULL_ATTENTION]
    if isinstance(params, dict) and params:
        scaling = dict(params)
        theta = float(scaling.pop("rope_theta", hf.get("rope_theta", default_theta)))
    else:
        scaling = dict(hf.get("rope_scaling") or {})
        theta = float(hf.get("rope_theta", default_theta))
    kind = str(scaling.get("rope_type", scaling.get("type", "default")))
    partial = scaling.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0) and not family.keys.reads(PARTIAL_ROTARY_KEY):
        problems.append(f"{where}: partial_rotary_factor {partial} is not supported for {family.architecture} (RoPE "
                        "over the whole head only)")
    if kind not in rope_types:
        problems.append(f"{where}: rope type {kind!r} is not supported; supported: {', '.join(rope_types)}")
        return theta, None
    if kind == "default":
        return theta, None
    if kind in ("yarn", "longrope"):
        return theta, extended_rope(hf, kind, scaling, where, problems)
    out: dict[str, Any] = {"rope_type": kind, "factor": float(scaling.get("factor", 1.0))}
    if kind == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in scaling]
        if missing:
            problems.append(f"{where}: llama3 rope scaling lacks {', '.join(missing)}")
        out.update(low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                   high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                   # transformers falls back to max_position_embeddings; so does this.
                   original_max_position_embeddings=int(scaling.get("original_max_position_embeddings")
                                                        or hf.get("max_position_embeddings") or 0))
    return theta, out


def extended_rope(hf: dict[str, Any], kind: str, scaling: dict[str, Any], where: str,
                   problems: list[str]) -> dict[str, Any]:
    """yarn's or longrope's settings in config.json's form, with transformers' fallbacks: the original context
    from the top level (Phi-3) or max_position_embeddings, longrope's factor from the two lengths."""
    max_pos = hf.get("max_position_embeddings")
    original = scaling.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings") or max_pos
    if not original:
        problems.append(f"{where}: {kind} rope scaling needs original_max_position_embeddings")
        original = 1
    factor = scaling.get("factor")
    if factor is None:
        factor = float(max_pos) / float(original) if max_pos else 1.0
    out: dict[str, Any] = {"rope_type": kind, "factor": float(factor),
                           "original_max_position_embeddings": int(original)}
    keep = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate") if kind == "yarn" \
        else ("attention_factor", "long_factor", "short_factor")
    out.update({k: scaling[k] for k in keep if scaling.get(k) is not None})
    return out  # the job checks (config/validate.py) count longrope's factors
