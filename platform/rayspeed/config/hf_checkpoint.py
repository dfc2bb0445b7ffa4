"""What a Hugging Face checkpoint directory must hold for a model shape, checked from the file headers alone
(torch-free, no tensor read): the tensor names and shapes, the shard files, the tokenizer's size.

    weight_problems("/models/qwen", shape)     # [] or one line per missing file / tensor / wrong shape
    tokenizer_problems("/models/qwen", 151936) # [] or "the tokenizer has 151 646 ids, the model 1000"

The names map rayspeed's parameters (the Transformer's state_dict names) to the family's checkpoint names (its
record in rayspeed.families); `partition_dim` says how a tensor-parallel rank slices each one.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Optional

from rayspeed import families
from rayspeed.config.shape import ModelShape
from rayspeed.families import Family, TensorNames
from rayspeed.families.family import QK_NORM_PER_PROJECTION

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

def names_of(family: Optional[Family]) -> TensorNames:
    return (family or families.DEFAULT).tensor_names


def hf_name(name: str, family: Optional[Family] = None) -> str:
    """transformers' name of rayspeed parameter `name` (KeyError for a name with no counterpart)."""
    return names_of(family).hf_name(name)


def rayspeed_name(hf: str, family: Optional[Family] = None) -> Optional[str]:
    """rayspeed's name of transformers tensor `hf`, or None when rayspeed has no such parameter."""
    return names_of(family).rayspeed_name(hf)


def partition_dim(name: str, family: Optional[Family] = None) -> Optional[int]:
    """The dimension tensor parallelism splits rayspeed parameter `name` along (None: replicated)."""
    return names_of(family).partition_dim(name)


def param_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model under rayspeed's names with its full shape (a tied head is not listed)."""
    h, f, v = shape.hidden_size, shape.ffn_hidden_size, shape.vocab_size
    out: dict[str, tuple[int, ...]] = {"embed.weight": (v, h), "norm.weight": (h,)}
    if not shape.tie_embeddings:
        out["head.weight"] = (v, h)
    for i in range(shape.num_layers):
        p = f"layers.{i}."
        out.update({p + "attn_norm.weight": (h,), p + "mlp_norm.weight": (h,)})
        own_attention = shape.family.attention.params or shared_attention_params
        out.update({p + suffix: dims for suffix, dims in own_attention(shape).items()})
        if shape.is_moe(i):  # every expert's matrices stacked, [experts, out, in]
            e, fe = shape.num_experts, shape.expert_ffn_hidden_size
            out.update({p + "mlp.router.weight": (e, h), p + "mlp.w_gate": (e, fe, h), p + "mlp.w_up": (e, fe, h),
                        p + "mlp.w_down": (e, h, fe)})
        else:
            out.update({p + "mlp.w_gate.weight": (f, h), p + "mlp.w_up.weight": (f, h),
                        p + "mlp.w_down.weight": (h, f)})
        names = shape.family.tensor_names
        if names.hidden_norms == 4:  # Gemma: after attention and after the MLP as well
            out.update({p + "attn_post_norm.weight": (h,), p + "mlp_post_norm.weight": (h,)})
        out.update({p + suffix: dims for suffix, dims in shape.family.layer_params(shape, i).items()})
    return out


def shared_attention_params(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """The shared attention's parameters of a block: q, k, v, o, the q/k/v biases of a family whose names have
    them, its q/k norms (per head, or over the projections: OLMo 2)."""
    h, q, kv = shape.hidden_size, shape.q_dim, shape.kv_dim
    out: dict[str, tuple[int, ...]] = {"attn.wq.weight": (q, h), "attn.wk.weight": (kv, h), "attn.wv.weight": (kv, h),
                                       "attn.wo.weight": (h, q)}
    if shape.qkv_bias:
        out.update({"attn.wq.bias": (q,), "attn.wk.bias": (kv,), "attn.wv.bias": (kv,)})
    qk_norm = shape.family.tensor_names.qk_norm
    if qk_norm is not None:
        whole = qk_norm == QK_NORM_PER_PROJECTION
        out.update({"attn.q_norm.weight": (q if whole else shape.head_dim,),
                    "attn.k_norm.weight": (kv if whole else shape.head_dim,)})
    return out


def checkpoint_layout(shape: ModelShape) -> dict[str, tuple[str, int]]:
    """rayspeed parameter -> (checkpoint tensor, first row of the parameter in it): 0 except for the parts of a
    fused tensor (Phi-3's qkv_proj, gate_up_proj), stacked along rows in the family's order."""
    names, shapes = shape.family.tensor_names, param_shapes(shape)
    converted = converted_params(shape)
    out: dict[str, tuple[str, int]] = {}
    for name in shapes:
        if names.expert_names(name, 1) or name in converted:
            continue  # one tensor per expert (expert_layout), or held in another form (stored_forms)
        hf = names.hf_name(name)
        parts = names.fused_parts(hf)
        offset = sum(shapes[p][0] for p in parts[:parts.index(name)]) if parts else 0
        out[name] = (hf, offset)
    return out


def expert_layout(shape: ModelShape) -> dict[str, list[str]]:
    """Stacked expert parameter -> the checkpoint's tensor of each expert, expert 0 first (empty for a dense
    model)."""
    names, converted = shape.family.tensor_names, converted_params(shape)
    out = {}
    for name in param_shapes(shape):
        per_expert = [] if name in converted else names.expert_names(name, shape.num_experts)
        if per_expert:
            out[name] = per_expert
    return out


def converted_params(shape: ModelShape) -> frozenset[str]:
    """The parameters the family's checkpoints hold in another form than one tensor each (Family.stored)."""
    stored = shape.family.stored
    return frozenset(stored.converted(shape)) if stored is not None else frozenset()


def stored_forms(shape: ModelShape) -> tuple[dict[str, tuple[int, ...]], ...]:
    """The checkpoint tensors of each form the converted parameters may be held in (the export's first)."""
    stored = shape.family.stored
    return tuple(dict(form) for form in stored.forms(shape)) if stored is not None else ()


def held_form(stored: Any, shape: ModelShape) -> Optional[dict[str, tuple[int, ...]]]:
    """The form (stored_forms) a checkpoint holding the tensor names `stored` is in; None when it holds none
    whole ({} for a family without converted parameters)."""
    forms = stored_forms(shape)
    if not forms:
        return {}
    return next((form for form in forms if all(name in stored for name in form)), None)


def checkpoint_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the shape implies, with its shape (a fused tensor: its parts' rows added); the
    converted parameters' tensors are stored_forms'."""
    shapes = param_shapes(shape)
    out: dict[str, tuple[int, ...]] = {}
    for name, (hf, _) in checkpoint_layout(shape).items():
        rows = shapes[name][0] + (out[hf][0] if hf in out else 0)
        out[hf] = (rows, *shapes[name][1:])
    for name, per_expert in expert_layout(shape).items():
        out.update({hf: shapes[name][1:] for hf in per_expert})
    return out


def read_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header: {tensor name: {"dtype", "shape", "data_offsets"}} (raises ValueError on a
    file that is not safetensors or is cut short)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 100 << 20:
            raise ValueError("header length beyond the end of the file")
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    if 8 + n + end > size:
        raise ValueError(f"cut short: {size} bytes, the header needs {8 + n + end}")
    return header


# A multimodal checkpoint's text model under its own prefixes (Gemma3ForConditionalGeneration as the hub holds it
# and as transformers 5 names it in memory), and the parts rayspeed keeps out (the vision tower and projector).
TEXT_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                       ("model.language_model.", "model."))
NON_TEXT_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_model_name(stored: str) -> Optional[str]:
    """The text model's name of a stored tensor (itself for a text-only checkpoint); None for a vision tensor."""
    if stored.startswith(NON_TEXT_PREFIXES):
        return None
    for prefix, text in TEXT_MODEL_PREFIXES:
        if stored.startswith(prefix):
            return text + stored[len(prefix):]
    return stored


def stored_names(files: dict[str, Path]) -> dict[str, str]:
    """Text-model name -> the name the checkpoint stores it under (weight_files' keys)."""
    return {name: stored for stored in files if (name := text_model_name(stored)) is not None}


def weight_files(model_dir: Path) -> tuple[dict[str, Path], list[str]]:
    """{stored tensor name: the file holding it} from the index (sharded) or the single file (stored_names maps
    the text model's names onto them)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return {}, [f"{index}: not a safetensors index with a weight_map ({e})"]
        files = {name: model_dir / str(fname) for name, fname in weight_map.items()}
        missing = sorted({p.name for p in files.values() if not p.is_file()})
        if missing:
            return files, [f"{model_dir}: shard file(s) {', '.join(missing)} listed in {INDEX_FILE} are missing "
                           "(download or copy the whole checkpoint)"]
        return files, []
    single = model_dir / SINGLE_FILE
    if single.is_file():
        try:
            return {name: single for name in read_header(single)}, []
        except (OSError, ValueError) as e:
            return {}, [f"{single}: unreadable safetensors file ({e}); copy it again"]
    return {}, [f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} (safetensors weights are required; set "
                "model.init: random to train this architecture from scratch)"]


def weight_problems(model_dir: str | Path, shape: ModelShape) -> list[str]:
    """Missing files, missing tensors and tensors whose shape disagrees with config.json (the shape)."""
    d = Path(model_dir)
    files, problems = weight_files(d)
    if problems:
        return problems
    headers: dict[Path, dict[str, Any]] = {}
    for p in sorted(set(files.values())):
        try:
            headers[p] = read_header(p)
        except (OSError, ValueError) as e:
            problems.append(f"{p}: unreadable safetensors file ({e}); copy it again")
    if problems:
        return problems
    missing, wrong = [], []
    stored = stored_names(files)
    form = held_form(stored, shape)
    if form is None:
        names = " | ".join(", ".join(sorted(f)[:3]) + " ..." for f in stored_forms(shape))
        missing.append(f"one of the stored forms ({names})")
        form = {}
    for hname, want in {**checkpoint_shapes(shape), **form}.items():
        f = files.get(stored.get(hname, hname))
        if f is None or (entry := headers[f].get(stored.get(hname, hname))) is None:
            missing.append(hname)
        elif tuple(entry["shape"]) != want:
            wrong.append(f"{hname} is {tuple(entry['shape'])} in {f.name}, config.json implies {want}")
    if missing:
        problems.append(f"{d}: weights lack {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''} "
                        f"({len(missing)} tensors); the checkpoint is partial or not a {shape.architecture}")
    if wrong:
        problems.append(f"{d}: tensor shapes disagree with config.json: {'; '.join(wrong[:4])}"
                        f"{' ...' if len(wrong) > 4 else ''}")
    return problems


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def tokenizer_size(model_dir: str | Path) -> Optional[int]:
    """1 + the largest id tokenizer.json can produce (its vocabulary and added tokens); None without one."""
    f = Path(model_dir) / "tokenizer.json"
    if not f.is_file():
        return None
    data = json.loads(f.read_text())
    vocab = (data.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))  # Unigram: a list
    ids += [int(t["id"]) for t in data.get("added_tokens") or []]
    return max(ids) + 1 if ids else 0


def tokenizer_problems(model_dir: str | Path, vocab_size: int) -> list[str]:
    """A tokenizer next to the checkpoint that can emit ids the model has no embedding for (for
    `data.tokenizer: model`)."""
    try:
        n = tokenizer_size(model_dir)
    except (OSError, ValueError, TypeError, KeyError) as e:
        return [f"{Path(model_dir) / 'tokenizer.json'}: unreadable ({e})"]
    if n is None:
        return [f"{model_dir}: no tokenizer.json (data.tokenizer: model needs the tokenizer saved with the model)"]
    if n > vocab_size:
        return [f"{Path(model_dir) / 'tokenizer.json'}: the tokenizer has {n} ids but the model's vocabulary is "
                f"{vocab_size}; use the model's own tokenizer or resize the model"]
    return []
