"""Each family's decoder, composed from parts (rayspeed.model.parts): one module per family whose computation
differs from Llama's, named as its record's module under rayspeed.families, holding its block and its MODEL
composition. A family without a module here is the Llama decoder (rayspeed.model.families.llama), so adding a family
is adding its files: nothing here lists them.

    composition_of(shape.family)      # Composition(block, norm, embed_scale, input_stage): what the decoder builds
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Optional

from rayspeed.families import records_of
from rayspeed.model.parts.blocks import Block
from rayspeed.model.parts.input_stage import TokenInput
from rayspeed.model.parts.norms import RMSNorm


@dataclass(frozen=True)
class Composition:
    """What a family's decoder is made of besides the parts every family shares (embedding, output head)."""
    families: tuple[Any, ...]
    """The family records (rayspeed.families) this composition runs."""
    block: type = Block
    """Its blocks' class (its attention and norm classes named there)."""
    norm: type = RMSNorm
    """The final norm's class (the blocks' own are the block's)."""
    embed_scale: bool = False
    """The embedding's output is multiplied by sqrt(hidden) (Gemma)."""
    input_stage: type[TokenInput] = TokenInput
    """What makes the first hidden states (`embed.*`): token embeddings, or a family's own stage (images)."""
    weights: Optional[Any] = None
    """Reads and writes the parameters its record's `stored` forms hold (None: every parameter one tensor):
    read(name, form, fetch, experts, shape) -> the parameter whole over tp, of the experts in `experts`, from the
    checkpoint tensors of `form` (fetch(name) -> a safetensors slice; fetch.shared(key, make) keeps one read for the
    next parameter); write(state, shape) -> the export's tensors of the first form."""

    def embedding_scale(self, hidden_size: int) -> Optional[float]:
        return math.sqrt(hidden_size) if self.embed_scale else None


@functools.cache
def compositions() -> tuple[Composition, ...]:
    """The MODEL of every module of this package."""
    return records_of(__path__, __name__, "MODEL", Composition)


@dataclass(frozen=True)
class VisionComposition:
    """What a vision-language architecture's image path is made of: the input stage that writes the projected image
    features over their placeholder tokens (its projector named there)."""
    records: tuple[Any, ...]
    """The vision-language records (rayspeed.families.vision) this composition runs."""
    input_stage: type[TokenInput]


@functools.cache
def vision_compositions() -> tuple[VisionComposition, ...]:
    """The VISION_MODEL of every module of this package."""
    return records_of(__path__, __name__, "VISION_MODEL", VisionComposition)


def input_stage_of(dims: Any) -> type[TokenInput]:
    """The first piece's class: the image path's stage of a vision-language shape, else the text family's."""
    if dims.image_path is None:
        return composition_of(dims.family).input_stage
    record = dims.image_path.record
    return next(v.input_stage for v in vision_compositions() if any(r is record for r in v.records))


def composition_of(family: Any) -> Composition:
    """The composition that runs `family`; the Llama decoder for a family no module composes."""
    for model in compositions():
        if any(f is family for f in model.families):
            return model
    return Composition(families=(family,))
