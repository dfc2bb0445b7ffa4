"""Hugging Face `config.json` <-> the job's model section. Pure Python: the planner plans a real model from here.

    hf = read_pretrained_config("meta-llama/Llama-3.2-1B")    # a local directory or a hub id
    keys, problems = model_keys_from_hf(hf, where="<dir>/config.json", seq_len=4096)
    problems = apply_pretrained(raw_model_section, cfg.model)  # parse(): fills what the job left unset
    to_hf_config(ModelShape.from_config(cfg.model))            # the export's config.json

Both forms of RoPE settings are read (config/hf_rope.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any, Optional

from rayspeed import families
from rayspeed.config.examples import prepare_hint
from rayspeed.config.hf_rope import local_rope, partial_rotary, rope_from_hf
from rayspeed.config.moe_keys import MOE_SHAPE_KEYS, aux_coef_from_hf, moe_keys_from_hf, unsupported_reason
from rayspeed.config.shape import ModelShape, rope_fields
from rayspeed.config.vision_shape import vision_shape_from_hf
from rayspeed.families import Family
from rayspeed.families.family import (
    FULL_ATTENTION,
    HEAD_DIM_KEY,
    LAYER_TYPES,
    PARTIAL_ROTARY_KEY,
    QUERY_SCALE_KEY,
    SLIDING_ALL_LAYERS,
    SLIDING_ATTENTION,
    SLIDING_LAYER_TYPES,
    SLIDING_USE_FLAG,
)

CONFIG_FILE = "config.json"

# Keys of the job's model section that config.json decides (model key -> how it is compared).
SHAPE_KEYS = ("architecture", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "ffn_hidden_size", "vocab_size", "tie_embeddings", "rope_theta", "rope_scaling", "norm_eps",
              "max_position_embeddings", "hidden_act", "sliding_window", "layer_types", "rope_local_theta",
              "query_pre_attn_scalar", "partial_rotary_factor", "attn_logit_softcapping", "final_logit_softcapping",
              "family_keys", "image_path", *MOE_SHAPE_KEYS)

# transformers' Qwen2Config / Qwen3Config default.
MAX_WINDOW_LAYERS_DEFAULT = 28


class PretrainedError(ValueError):
    """model.pretrained cannot be used as given; the message names the file or key and the fix."""


def is_local_ref(ref: str) -> bool:
    """A directory on this machine (or meant to be one: an absolute or ./ path), as opposed to a hub id."""
    p = os.path.expanduser(ref)
    return os.path.isdir(p) or ref.startswith(("/", "./", "../", "~")) or os.sep + os.sep in ref


def resolve_file(ref: str, filename: str = CONFIG_FILE) -> Path:
    """The local path of `filename` of the model `ref`: in the directory, or through huggingface_hub's cached
    download (exactly what transformers does with a hub id; HF_HOME / HF_HUB_OFFLINE apply)."""
    if is_local_ref(ref):
        d = Path(os.path.expanduser(ref))
        if not d.is_dir():
            raise PretrainedError(f"model.pretrained: {ref}: no such directory (a local model directory or a "
                                  f"Hugging Face hub id such as meta-llama/Llama-3.2-1B){prepare_hint(ref)}")
        f = d / filename
        if not f.is_file():
            raise PretrainedError(f"model.pretrained: {f} is missing (save the model with save_pretrained, which "
                                  f"writes {filename})")
        return f
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:  # a dependency of transformers; named here so the fix is obvious
        raise PretrainedError("model.pretrained: a hub id needs huggingface_hub (pip install transformers)") from None
    try:  # the local cache first: a machine without network reuses earlier downloads, with no request at all
        return Path(hf_hub_download(ref, filename, local_files_only=True))
    except Exception:
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    fixes = (f"download it where there is network (`hf download {ref}`, into the same HF_HOME), or set "
             "model.pretrained to a local model directory")
    if offline:
        raise PretrainedError(f"model.pretrained: {ref}: {filename} is not in the local Hugging Face cache and "
                              f"HF_HUB_OFFLINE is set; {fixes}")
    # Behind a proxy a direct connection says nothing: huggingface_hub goes through it (and its retries apply).
    proxied = any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                                              "all_proxy"))
    down = None if proxied else _hub_unreachable()
    if down:  # said at once: huggingface_hub would retry for about 25 s before saying the same
        raise PretrainedError(f"model.pretrained: {ref}: not in the local Hugging Face cache, and the hub cannot be "
                              f"reached ({down}); {fixes} (HF_HUB_OFFLINE=1 then uses the cache only)")
    try:
        return Path(hf_hub_download(ref, filename))
    except Exception as e:
        first = _first_sentence(str(e)) if str(e) else type(e).__name__
        raise PretrainedError(f"model.pretrained: {ref}: cannot fetch {filename} from the Hugging Face hub "
                              f"({first}); check the id, HF_TOKEN for gated models, or use a local directory") from None


def _first_sentence(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0]
    cut = line.find(". ")
    line = line[: cut + 1] if 0 < cut < limit else line
    return line if len(line) <= limit else line[: line.rfind(" ", 0, limit)] + " ..."


def _hub_unreachable(timeout_s: float = 3.0) -> Optional[str]:
    """Why the hub's host cannot be reached with one try (None when it answers a TCP connection)."""
    import socket
    from urllib.parse import urlsplit

    endpoint = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as e:
        return f"{host}: {e.strerror or e}"


def read_pretrained_config(ref: str) -> tuple[dict[str, Any], Path]:
    """(config.json as a dict, its path)."""
    path = resolve_file(ref)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PretrainedError(f"model.pretrained: {path} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise PretrainedError(f"model.pretrained: {path} must hold a JSON object")
    return data, path


def text_model_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config.json whose text model is a family's (Gemma3ForConditionalGeneration): its text_config,
    named as that family's text-only architecture; any other config.json as it is."""
    archs = hf.get("architectures") or []
    family = families.text_family(str(archs[0])) if archs else None
    text_config = hf.get("text_config")
    vision = families.vision_language(str(archs[0])) if archs else None
    if family is None and isinstance(text_config, dict) and vision is not None:
        # A vision-language architecture's text model is any family's, named by its own model_type.
        try:
            family = families.by_model_type(str(text_config.get("model_type", vision.text_model_type)))
        except KeyError:
            return {**text_config, "architectures": None}
    if family is None or not isinstance(text_config, dict):
        return hf
    text = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config", "architectures", "model_type")}
    return {**text, **hf["text_config"], "architectures": [family.architecture], "model_type": family.model_type}


def _architecture(hf: dict[str, Any]) -> Optional[str]:
    archs = hf.get("architectures") or []
    if archs:
        return str(archs[0])
    try:
        return families.by_model_type(str(hf.get("model_type"))).architecture
    except KeyError:
        return f"model_type {hf.get('model_type')!r}"


def model_keys_from_hf(hf: dict[str, Any], where: str, seq_len: Optional[int] = None
                       ) -> tuple[dict[str, Any], list[str]]:
    """The job's model keys a config.json decides, and what in it rayspeed cannot run (each naming the file)."""
    image_path, problems = vision_shape_from_hf(hf, where)
    hf = text_model_config(hf)
    arch = _architecture(hf)
    family = families.find(arch)
    if family is None:
        reason = unsupported_reason(arch)
        problems.append(f"{where}: architecture {arch} is not supported{': ' + reason if reason else ''}; "
                        f"supported: {', '.join(families.names())}")
        return {}, problems
    missing = [k for k in family.keys.required if hf.get(k) is None]
    if missing:
        problems.append(f"{where}: lacks {', '.join(missing)}")
        return {}, problems
    h, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    act = hf.get(family.keys.activation, family.defaults[family.keys.activation])
    if act not in family.keys.activations:
        problems.append(f"{where}: {family.keys.activation} {act!r} is not supported for {arch}; supported: "
                        f"{', '.join(family.keys.activations)}")
    head_dim = hf.get("head_dim")
    if head_dim is not None and heads and int(head_dim) != family.head_dim(h, heads, int(head_dim)):
        problems.append(f"{where}: head_dim {head_dim} differs from hidden_size / num_attention_heads = {h // heads}; "
                        "not supported")
    if not family.qkv_bias and hf.get("attention_bias"):
        problems.append(f"{where}: attention_bias true (biases on q, k, v and o) is not supported for {arch}")
    if hf.get("mlp_bias"):
        problems.append(f"{where}: mlp_bias true is not supported")
    caps = softcaps(family, hf, where, problems)
    if hf.get("use_bidirectional_attention"):
        problems.append(f"{where}: use_bidirectional_attention true is not supported (causal language models only)")
    window, layer_types = sliding_window(family, hf, where, problems)
    theta, scaling = rope_from_hf(hf, family, where, problems)
    scalar = hf.get(QUERY_SCALE_KEY, family.defaults.get(QUERY_SCALE_KEY)) \
        if family.keys.reads(QUERY_SCALE_KEY) else None
    max_pos = hf.get("max_position_embeddings")
    keys = {
        "architecture": arch,
        "hidden_size": h,
        "num_layers": int(hf["num_hidden_layers"]),
        "num_heads": heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
        # Only a family that reads config.json's head_dim carries it; for the others hidden / heads decides.
        "head_dim": int(head_dim) if head_dim and family.keys.reads(HEAD_DIM_KEY) else None,
        "ffn_hidden_size": int(hf["intermediate_size"]),
        "vocab_size": int(hf["vocab_size"]),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", family.tie_embeddings_default)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "norm_eps": float(hf.get("rms_norm_eps", family.defaults["rms_norm_eps"])),
        "max_position_embeddings": int(max_pos) if max_pos else None,
        "hidden_act": str(act),
        "sliding_window": window,
        "layer_types": layer_types,
        "rope_local_theta": local_rope(hf, family, where, problems),
        "query_pre_attn_scalar": float(scalar) if scalar else None,
        "partial_rotary_factor": partial_rotary(hf) if family.keys.reads(PARTIAL_ROTARY_KEY) else None,
        **caps,
        "family_keys": {key: hf.get(key, default) for key, default in family.keys.own.items()} or None,
        "image_path": image_path,
        **moe_keys_from_hf(family, hf, where, problems),
    }
    return keys, problems


def softcaps(family: Family, hf: dict[str, Any], where: str, problems: list[str]) -> dict[str, Optional[float]]:
    """The soft-capping keys of a family that reads them (None: none); a cap given to another family is a problem."""
    caps = {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = hf.get(key, family.defaults.get(key)) if family.keys.reads(key) else None
        if not family.keys.reads(key) and hf.get(key) is not None:
            problems.append(f"{where}: {key} {hf[key]} (soft-capping) is not supported for {family.architecture}")
        caps[key] = float(value) if value else None
    return caps


def sliding_window(family: Family, hf: dict[str, Any], where: str, problems: list[str]
                   ) -> tuple[Optional[int], Optional[list[str]]]:
    """(window, layer types) as transformers reads config.json for the family: (None, None) without a window;
    layer types None when every layer slides."""
    given = hf.get("sliding_window", family.defaults.get("sliding_window"))
    if family.keys.sliding_window == SLIDING_USE_FLAG and not hf.get("use_sliding_window"):
        return None, None
    if not given:
        return None, None
    if family.keys.sliding_window == SLIDING_ALL_LAYERS:
        return int(given), None
    if family.keys.sliding_window not in (SLIDING_USE_FLAG, SLIDING_LAYER_TYPES):
        problems.append(f"{where}: sliding_window {given} (sliding-window attention) is not supported for "
                        f"{family.architecture}")
        return None, None
    types = hf.get("layer_types")
    n = int(hf["num_hidden_layers"])
    if types is None and family.keys.sliding_window == SLIDING_USE_FLAG:
        first = int(hf.get("max_window_layers", MAX_WINDOW_LAYERS_DEFAULT))
        types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(n)]
    elif types is None:  # Gemma 3: every pattern-th layer is global
        pattern = int(hf.get("sliding_window_pattern", family.defaults["sliding_window_pattern"]))
        types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(n)]
    types = [str(t) for t in types]
    if len(types) != n or set(types) - set(LAYER_TYPES):
        problems.append(f"{where}: layer_types must give one of {', '.join(LAYER_TYPES)} for each of the "
                        f"{n} layers, got {types}")
        return None, None
    if SLIDING_ATTENTION not in types:
        return None, None
    return int(given), types


def _same(key: str, a: Any, b: Any) -> bool:
    if key == "rope_scaling":
        return rope_fields(a) == rope_fields(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


EXTENSION_ROPE_TYPES = ("linear", "yarn", "llama3")


def context_extension(explicit: Collection[str], model: Any, keys: dict[str, Any]) -> set[str]:
    """The keys a job may set apart from config.json to train longer than the checkpoint's positions: a larger
    model.max_position_embeddings, and with it a model.rope_scaling of a type that stretches RoPE (linear, yarn,
    llama3; the positions then run past the pretraining length as those types define). Anything else that differs
    stays a problem."""
    given, known = getattr(model, "max_position_embeddings", None), keys.get("max_position_embeddings")
    if "max_position_embeddings" not in explicit or not given or not known or int(given) <= int(known):
        return set()
    out = {"max_position_embeddings"}
    scaling = getattr(model, "rope_scaling", None) if "rope_scaling" in explicit else None
    if scaling and str(scaling.get("rope_type", scaling.get("type", ""))) in EXTENSION_ROPE_TYPES:
        out.add("rope_scaling")
    return out


def apply_pretrained(explicit: Collection[str], model: Any) -> list[str]:
    """Fill `model` (a ModelConfig, in place) from its model.pretrained config.json. `explicit`: the model keys
    the job file and --set gave; one that differs from config.json is a problem naming both values."""
    try:
        hf, path = read_pretrained_config(str(model.pretrained))
    except PretrainedError as e:
        return [str(e)]
    keys, problems = model_keys_from_hf(hf, str(path), seq_len=model.seq_len)
    if problems:
        return problems
    extends = context_extension(explicit, model, keys)
    for key in SHAPE_KEYS:
        value = keys[key]
        if key in extends:
            continue
        if key in explicit and not _same(key, getattr(model, key), value):
            longer = ""
            if key in ("rope_scaling", "max_position_embeddings"):
                longer = (f"; to train longer than the checkpoint's {keys['max_position_embeddings']} positions, set "
                          "model.max_position_embeddings above them, with model.rope_scaling of type "
                          f"{', '.join(EXTENSION_ROPE_TYPES)} if RoPE should stretch")
            problems.append(f"model.{key}: the job sets {getattr(model, key)!r} but {path} says {value!r}; drop "
                            f"model.{key} (model.pretrained decides it) or point model.pretrained at another model"
                            + longer)
            continue
        setattr(model, key, value)
    if "init_std" not in explicit and hf.get("initializer_range") is not None:
        model.init_std = float(hf["initializer_range"])  # only matters for model.init: random
    if "router_aux_loss_coef" not in explicit:  # a training setting: the job may weigh the balance loss otherwise
        model.router_aux_loss_coef = aux_coef_from_hf(families.by_architecture(keys["architecture"]), hf)
    return problems


def to_hf_config(shape: ModelShape, bos_token_id: Optional[int] = None, eos_token_id: Any = None,
                 dtype: str = "float32") -> dict[str, Any]:
    """config.json of `shape` in transformers 5's form, for the architecture the shape names."""
    family = shape.family
    rope: dict[str, Any] = {"rope_theta": shape.rope_theta, "rope_type": shape.rope_type}
    rope.update({k: v for k, v in (shape.rope_scaling or {}).items() if k != "rope_type"})
    cfg: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.ffn_hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        family.keys.activation: shape.hidden_act,
        "max_position_embeddings": max(shape.max_position_embeddings or 0, shape.seq_len),
        "initializer_range": shape.init_std,
        "rms_norm_eps": shape.norm_eps,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": shape.tie_embeddings,
        "rope_parameters": rope,
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": dtype,
    }
    cfg.update({key: shape.family_key(key) for key in family.keys.own})
    cfg.update(family.export_extras(shape))
    return cfg


def pretrained_problems(cfg: Any, explicit: set[str]) -> list[str]:
    """parse()'s hook: fill cfg.model from model.pretrained's config.json, then check what the job will read
    from the checkpoint (weight headers when its weights are used, the tokenizer with data.tokenizer: model).
    Hub ids are checked for config.json only here: their weights are fetched by the workers."""
    from rayspeed.config.hf_checkpoint import tokenizer_problems, weight_problems

    problems = apply_pretrained(explicit, cfg.model)
    ref = str(cfg.model.pretrained)
    if problems or not is_local_ref(ref):
        return problems
    local = os.path.expanduser(ref)
    if cfg.model.init == "pretrained":
        problems += weight_problems(local, ModelShape.from_config(cfg.model))
    if cfg.data.tokenizer == "model":
        problems += tokenizer_problems(local, cfg.model.vocab_size)
    return problems
