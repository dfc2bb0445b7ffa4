"""The image path's weights (a vision-language checkpoint's tower and projector) in and out: read whole on every rank
(they are replicated), under the names the record maps (the hub's, transformers 5's), checked against the module
built from config.json: a tensor missing, or of another shape, names itself and the file.

    read_image_path(params, model_dir, shape.image_path, what)   # params: (rayspeed name, parameter) under embed.
    image_path_tensors(state, shape.image_path)                  # an export's names of the same tensors
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from rayspeed.config.hf_checkpoint import weight_files
from rayspeed.config.vision_shape import VisionShape
from rayspeed.families.vision import PROJECTOR_PREFIX, TOWER_PREFIX

IMAGE_PATH_PREFIXES = (TOWER_PREFIX, PROJECTOR_PREFIX)


def is_image_path(name: str) -> bool:
    return name.startswith(IMAGE_PATH_PREFIXES)


def read_image_path(params: Sequence[tuple[str, torch.Tensor]], model_dir: str, vision: VisionShape,
                    what: str) -> int:
    """Copy the checkpoint's tower and projector into `params`; the elements read (ValueError naming the tensor)."""
    from safetensors import safe_open

    files, problems = weight_files(Path(model_dir))
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems))
    stored = {ours: name for name in files if (ours := vision.record.rayspeed_name(name)) is not None}
    missing = [name for name, _ in params if name not in stored]
    if missing:
        raise ValueError(f"{what}: {model_dir} lacks the image path's {', '.join(missing[:3])}"
                             f"{' ...' if len(missing) > 3 else ''} ({vision.architecture}: a tower and a projector "
                             "as its config.json's vision_config says)")
    elements = 0
    with torch.no_grad():
        for name, p in params:
            with safe_open(str(files[stored[name]]), framework="pt") as fh:
                value = fh.get_tensor(stored[name])
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"{what}: {stored[name]} in {files[stored[name]].name} is {tuple(value.shape)}, "
                                     f"config.json's vision_config makes it {tuple(p.shape)}")
            p.copy_(value.to(device=p.device, dtype=p.dtype))
            elements += value.numel()
    return elements


def read_image_path_whole(model_dir: str, vision: VisionShape) -> dict[str, torch.Tensor]:
    """Every image-path tensor of the checkpoint, whole, fp32, under rayspeed's names (the base an adapter job's
    export merges into: a frozen tower is not in the job's checkpoints)."""
    from safetensors import safe_open

    files, problems = weight_files(Path(model_dir))
    if problems:
        raise ValueError("; ".join(problems))
    out = {}
    for stored, path in files.items():
        ours = vision.record.rayspeed_name(stored)
        if ours is not None:
            with safe_open(str(path), framework="pt") as fh:
                out[ours] = fh.get_tensor(stored).float()
    return out


def vision_language_tensors(text: dict[str, Any], state: dict[str, Any], vision: VisionShape) -> dict[str, Any]:
    """The whole model's export tensors: the text model's (transformers' text-only names, `text`) moved under the
    record's text prefix, and the image path's."""
    missing = [p for p in IMAGE_PATH_PREFIXES if not any(k.startswith(p) for k in state)]
    if missing:
        raise KeyError(f"the weights lack the image path's {' and '.join(missing)}* tensors")
    prefix = vision.record.text_prefix
    out = {(prefix + k[len("model."):] if k.startswith("model.") else k): v for k, v in text.items()}
    out.update({k: v.detach().to("cpu").contiguous() for k, v in image_path_tensors(state, vision).items()})
    return out


def image_path_tensors(state: dict[str, Any], vision: VisionShape) -> dict[str, Any]:
    """The export's tensors of the image path: rayspeed's names -> transformers 5.24's."""
    out = {}
    for name, value in state.items():
        for ours, theirs in vision.record.written:
            if name.startswith(ours):
                out[theirs + name[len(ours):]] = value
    return out
