"""Hugging Face safetensors weights in and out of rayspeed's model.

    load_hf_weights(model, "/models/qwen", shape, tp=groups.tp)   # this rank's slices, read where they lie
    hf_tensors(full_state, shape)                                  # rayspeed names -> transformers names

Loading reads only what this rank holds: for each of its parameters (a whole Transformer or one pipeline
stage, under the Transformer's names) it opens the tensor with `safe_open(...).get_slice` and reads the rows
or columns of its tensor-parallel slice. Build the model inside `parallel.layers.deferred_init()` first, so
no rank ever holds a full tensor it does not need.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

from rayspeed.config.hf_checkpoint import (
    checkpoint_layout,
    converted_params,
    expert_layout,
    held_form,
    param_shapes,
    stored_names,
    weight_files,
    weight_problems,
)
from rayspeed.config.hf_config import is_local_ref
from rayspeed.config.shape import ModelShape
from rayspeed.model.image_weights import is_image_path, read_image_path, read_image_path_whole

log = logging.getLogger(__name__)

# What a training job needs from a hub repository (not the .bin/.pth/gguf duplicates some carry).
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


class HFWeightsError(ValueError):
    """The checkpoint does not hold what the model needs; the message names the file and tensor."""


def local_model_dir(ref: str) -> str:
    """The directory holding the checkpoint `ref`: itself, or the hub repository's cached snapshot (downloaded
    through huggingface_hub like transformers does; several ranks of a machine share its cache and lock)."""
    if is_local_ref(ref):
        return os.path.expanduser(ref)
    from huggingface_hub import snapshot_download

    return snapshot_download(ref, allow_patterns=HUB_PATTERNS)


def named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(Transformer name, parameter) of this rank's part, each parameter once (a tied head is the embedding)."""
    from rayspeed.model.export import is_pipeline

    if is_pipeline(model):
        from rayspeed.model.decoder import canonical_named_parameters

        pairs: Iterable = canonical_named_parameters(model)
    else:
        pairs = model.named_parameters()
    seen, out = set(), []
    for name, p in pairs:
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def _rank_slice(view: Any, dim: Optional[int], tp: Any, offset: int = 0, rows: Optional[int] = None
                ) -> torch.Tensor:
    """This rank's part of a checkpoint tensor: along `dim` split over tp; `offset` and `rows`: the parameter's own
    rows of a fused tensor (the rank then reads only its slice of that part)."""
    ws = int(getattr(tp, "world_size", 1) or 1) if tp is not None else 1
    if rows is not None and (dim is None or dim == 0):
        n = rows // ws if dim == 0 else rows
        lo = offset + (tp.rank * n if dim == 0 and ws > 1 else 0)
        return view[lo:lo + n]
    if dim is None or ws == 1:
        return view[:]
    n = view.get_shape()[dim] // ws
    lo, hi = tp.rank * n, (tp.rank + 1) * n
    return view[lo:hi] if dim == 0 else view[:, lo:hi]


def load_hf_weights(model: torch.nn.Module, model_dir: str, shape: ModelShape, tp: Any = None,
                    what: str = "model.pretrained") -> dict[str, Any]:
    """Copy this rank's slices of the checkpoint in model_dir into `model` (in place, before DeepSpeed wraps it).

    Checks the headers first (every tensor present, each with the shape config.json implies) and raises
    HFWeightsError naming what is wrong. Returns {"model_dir", "parameters", "elements", "bytes_read"}.
    """
    from safetensors import safe_open

    problems = weight_problems(model_dir, shape)
    if problems:
        raise HFWeightsError(f"{what}: " + "; ".join(problems))
    files, _ = weight_files(Path(model_dir))
    stored = stored_names(files)
    expected = param_shapes(shape)
    layout, experts = checkpoint_layout(shape), expert_layout(shape)
    names, converted = shape.family.tensor_names, converted_params(shape)
    by_file: dict[Path, list[tuple[str, str, torch.Tensor]]] = {}
    expert_dims: dict[str, int] = {}
    nbytes, views = 0, Fp8Views(model_dir, files, stored)
    p: torch.Tensor  # a parameter here, the tensor it is read into (a slice of an expert stack too) below
    params = named_parameters(model)
    image_path = [(name, p) for name, p in params if is_image_path(name)]
    elements = 0
    if image_path:
        assert shape.image_path is not None  # only a vision-language shape builds an image path
        try:
            elements = read_image_path(image_path, model_dir, shape.image_path, what)
        except ValueError as e:
            raise HFWeightsError(str(e)) from None
    for name, p in params:
        if is_image_path(name):
            continue
        if name not in expected:
            raise HFWeightsError(f"{what}: the model has a parameter {name} that a {shape.architecture} checkpoint "
                                 "does not hold")
        if name in converted:
            n = _read_converted(p, name, views.fetch, shape, tp)
            elements, nbytes = elements + n, nbytes + n * p.element_size()
            continue
        # A stacked expert parameter is read expert by expert, each into its own row of the stack; sharded over ep,
        # a rank reads only the experts it holds.
        if name in experts:
            first = getattr(p, "first_expert", 0)
            if getattr(p, "tensor_model_parallel", False):  # split over tp too: a row of the stack's dim - 1
                expert_dims[name] = p.partition_dim - 1  # type: ignore[attr-defined]  # a tag torch's stubs lack
            parts = [(hf, p[e - first]) for e, hf in enumerate(experts[name]) if first <= e < first + p.shape[0]]
        else:
            parts = [(layout[name][0], p)]
        for hf, target in parts:
            hname = stored.get(hf, hf)
            by_file.setdefault(files[hname], []).append((name, hname, target))
    with torch.no_grad():
        for f, entries in sorted(by_file.items()):
            with safe_open(str(f), framework="pt") as fh:
                for name, hname, p in entries:
                    if name in experts:
                        value = _rank_slice(views(fh, hname), expert_dims.get(name), tp)
                        p.copy_(value.to(device=p.device, dtype=p.dtype))
                        elements, nbytes = elements + value.numel(), nbytes + value.numel() * value.element_size()
                        continue
                    fused = bool(names.fused_parts(layout[name][0]))
                    value = _rank_slice(views(fh, hname), names.partition_dim(name), tp, layout[name][1],
                                        expected[name][0] if fused else None)
                    if tuple(value.shape) != tuple(p.shape):
                        raise HFWeightsError(f"{what}: {hname} in {f.name}: this rank's slice is "
                                             f"{tuple(value.shape)}, the parameter {tuple(p.shape)}")
                    p.copy_(value.to(device=p.device, dtype=p.dtype))
                    elements, nbytes = elements + value.numel(), nbytes + value.numel() * value.element_size()
    return {"model_dir": str(model_dir), "parameters": len(params),
            "elements": elements, "bytes_read": nbytes}


FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
SCALE_SUFFIX = "_scale_inv"  # DeepSeek's (and Qwen's) block-scaled FP8: weight * scale, one scale a block


class _Whole:
    """A tensor read whole, sliced as a safetensors slice is (what _rank_slice takes)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A block-scaled FP8 matrix [rows, cols] in fp32: each (block rows x block cols) tile times its scale (the
    last tiles may be partial)."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return weight.float() * scale.repeat_interleave(block[1], dim=-1)[..., :cols]


class Fp8Views:
    """Checkpoint tensors as slices to read: a block-scaled FP8 weight (with its `_scale_inv` beside it) read whole
    and dequantized to fp32 first, since a rank's tp slice may cut inside a block; every other tensor as it is.
    The block size is config.json's quantization_config.weight_block_size (DeepSeek's 128 x 128 by default).
    `fetch`: the load's reader by name (the scales', and the converted parameters')."""

    def __init__(self, model_dir: Any, files: dict[str, Path], stored: dict[str, str]):
        import json

        self.files, self.stored = files, stored
        self.fetch = _Fetch(files, stored)
        try:
            quant = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config") or {}
        except (OSError, ValueError):
            quant = {}
        size = quant.get("weight_block_size") or (128, 128)
        self.block = (int(size[0]), int(size[1]))

    def __call__(self, fh: Any, hname: str) -> Any:
        view = fh.get_slice(hname)
        scale = self.stored.get(hname + SCALE_SUFFIX, hname + SCALE_SUFFIX)
        if view.get_dtype() not in FP8_DTYPES or scale not in self.files:
            return view
        return _Whole(dequantize_fp8(view[:], self.fetch(scale)[:], self.block))


class _Fetch:
    """Checkpoint tensors by name, each file opened once for the whole load."""

    def __init__(self, files: dict[str, Path], stored: dict[str, str]):
        self.files, self.stored = files, stored
        self.open: dict[Path, Any] = {}
        self.last: tuple[Any, Any] = (None, None)

    def shared(self, key: Any, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """make(), kept under `key` until another key is asked for: a tensor two parameters read in turn (gpt-oss's
        gate and up, both halves of one packed tensor) is read and dequantized once."""
        if self.last[0] != key:
            self.last = (key, make())
        return self.last[1]

    def __call__(self, hf: str) -> Any:
        from safetensors import safe_open

        name = self.stored.get(hf, hf)
        f = self.files[name]
        if f not in self.open:
            self.open[f] = safe_open(str(f), framework="pt")
        return self.open[f].get_slice(name)


def _converted(fetch: _Fetch, shape: ModelShape, name: str, experts: range) -> torch.Tensor:
    """Parameter `name` (whole over tp; of the experts in `experts` for an expert stack) from the form the
    checkpoint holds it in, by the family's model module (Composition.weights)."""
    from rayspeed.model.families import composition_of

    codec = composition_of(shape.family).weights
    form = held_form(fetch.stored, shape)
    if codec is None or not form:
        raise HFWeightsError(f"{shape.architecture}: no reader for {name}'s stored form")
    return codec.read(name, form, fetch, experts, shape)


def _read_converted(p: torch.Tensor, name: str, fetch: _Fetch, shape: ModelShape, tp: Any) -> int:
    """Read converted parameter `name` into p: this rank's experts, then its tp slice (a tp cut may fall inside a
    packed block: the whole blocks are read and dequantized, then sliced). Returns the elements read."""
    first = getattr(p, "first_expert", 0)  # an expert stack's first row (the codec ignores it for other tensors)
    value = _converted(fetch, shape, name, range(first, first + p.shape[0]))
    if getattr(p, "tensor_model_parallel", False) and tp is not None and tp.world_size > 1:
        dim = int(p.partition_dim)  # type: ignore[attr-defined]  # a tag torch's stubs lack
        value = value.narrow(dim, tp.rank * p.shape[dim], p.shape[dim])
    if tuple(value.shape) != tuple(p.shape):
        raise HFWeightsError(f"{name}: this rank's part is {tuple(value.shape)}, the parameter {tuple(p.shape)}")
    with torch.no_grad():
        p.copy_(value.to(device=p.device, dtype=p.dtype))
    return value.numel()


def read_whole(model_dir: str, shape: ModelShape, what: str = "model.pretrained") -> dict[str, torch.Tensor]:
    """Every parameter of the checkpoint in model_dir, whole, under rayspeed's names (fp32): the base an adapter
    is merged into (`rayspeed export --format hf` of an adapter job)."""
    from safetensors import safe_open

    problems = weight_problems(model_dir, shape)
    if problems:
        raise HFWeightsError(f"{what}: " + "; ".join(problems))
    files, _ = weight_files(Path(model_dir))
    stored, layout, expected = stored_names(files), checkpoint_layout(shape), param_shapes(shape)
    names, experts, converted = shape.family.tensor_names, expert_layout(shape), converted_params(shape)
    out: dict[str, torch.Tensor] = {}
    views = Fp8Views(model_dir, files, stored)
    for name in expected:
        if name == "head.weight" and shape.tie_embeddings:
            continue
        if name in converted:
            out[name] = _converted(views.fetch, shape, name, range(shape.num_experts)).float()
            continue
        if name in experts:
            stack = []
            for hf in experts[name]:
                with safe_open(str(files[stored.get(hf, hf)]), framework="pt") as fh:
                    stack.append(views(fh, stored.get(hf, hf))[:].float())
            out[name] = torch.stack(stack)
            continue
        hname = stored.get(layout[name][0], layout[name][0])
        with safe_open(str(files[hname]), framework="pt") as fh:
            fused = bool(names.fused_parts(layout[name][0]))
            out[name] = _rank_slice(views(fh, hname), None, None, layout[name][1],
                                    expected[name][0] if fused else None).float()
    if shape.image_path is not None:
        try:
            out.update(read_image_path_whole(model_dir, shape.image_path))
        except ValueError as e:
            raise HFWeightsError(f"{what}: {e}") from None
    return out


def hf_tensors(state: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """A full rayspeed state dict under transformers' names, contiguous (a tied head is left out, as
    save_pretrained leaves lm_head out of tied models). KeyError names a parameter the shape lacks."""
    expected = param_shapes(shape)
    missing = [k for k in expected if k not in state]
    if missing:
        raise KeyError(f"the weights lack {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    names, converted = shape.family.tensor_names, converted_params(shape)
    out = {}
    if converted:
        from rayspeed.model.families import composition_of

        codec = composition_of(shape.family).weights
        if codec is None:
            raise HFWeightsError(f"{shape.architecture}: no writer for its stored form")
        out.update(codec.write(state, shape))
    for name, want in expected.items():
        value = state[name]
        if tuple(value.shape) != want:
            raise ValueError(f"{name}: weights hold {tuple(value.shape)}, the shape says {want}")
        if name in converted:
            continue
        per_expert = names.expert_names(name, shape.num_experts)
        if per_expert:  # the hub's layout: one tensor per expert (what save_pretrained writes and vLLM reads)
            out.update({hf: value[e].detach().to("cpu").contiguous() for e, hf in enumerate(per_expert)})
            continue
        hf = names.hf_name(name)
        parts = names.fused_parts(hf)
        if parts and name != parts[0]:
            continue  # written with the first part
        value = torch.cat([state[p] for p in parts]) if parts else value
        out[hf] = value.detach().to("cpu").contiguous()
    return out


def hf_dir_mismatches(model_dir: str, shape: ModelShape) -> list[str]:
    """'key: saved X, job Y' for every field of the model function that differs between the Hugging Face
    directory's config.json and the job's shape (seq_len, init_std and the position limit may differ)."""
    import dataclasses
    from types import SimpleNamespace

    from rayspeed.config.hf_config import model_keys_from_hf, read_pretrained_config

    hf, path = read_pretrained_config(model_dir)
    keys, problems = model_keys_from_hf(hf, str(path), seq_len=shape.seq_len)
    if problems:
        return problems
    saved = ModelShape.from_config(SimpleNamespace(**keys, seq_len=shape.seq_len, init_std=shape.init_std))
    skip = {"seq_len", "init_std", "max_position_embeddings", "router_aux_loss_coef"}
    return [f"model.{f.name}: saved {getattr(saved, f.name)!r}, job {getattr(shape, f.name)!r}"
            for f in dataclasses.fields(ModelShape)
            if f.name not in skip and getattr(saved, f.name) != getattr(shape, f.name)]
