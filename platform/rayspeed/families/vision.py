"""What makes a vision-language architecture itself, in one frozen record: a vision tower whose features a projector
maps into the text model's width and writes at the image tokens' places, before a text model of any family rayspeed
reads (LLaVA: a CLIP or SigLIP tower, a two-layer MLP projector). Pure Python, below the config, like `Family`.

The record says what config.json holds (the towers accepted, the keys and their transformers defaults) and where the
checkpoint keeps the tower and the projector (the stored prefixes of each transformers version, onto rayspeed's
`embed.tower.` and `embed.projector.`). How it computes is its model module's (rayspeed.model.families, VISION_MODEL).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

# rayspeed's prefixes of the image path's parameters: inside the input stage, which a pipeline puts on its first stage.
TOWER_PREFIX = "embed.tower."
PROJECTOR_PREFIX = "embed.projector."

# vision_feature_select_strategy: drop the tower's class token (CLIP's first position) or keep every position.
SELECT_DEFAULT = "default"
SELECT_FULL = "full"


@dataclass(frozen=True)
class VisionLanguage:
    """One vision-language architecture as rayspeed reads and writes it."""
    architectures: tuple[str, ...]
    """Hugging Face architecture names; the first is the one an export writes."""
    model_type: str
    """config.json's `model_type`."""
    towers: Mapping[str, bool]
    """vision_config.model_type accepted -> whether the tower's first position is a class token (CLIP: yes)."""
    keys: Mapping[str, Any]
    """config.json's own keys with transformers' defaults (the image token's id, the feature layer, ...)."""
    stored: tuple[tuple[str, str], ...]
    """(checkpoint prefix, rayspeed prefix), longest first: the hub's legacy names and transformers 5's."""
    written: tuple[tuple[str, str], ...] = ()
    """(rayspeed prefix, the prefix an export writes): transformers 5's in-memory names of the tower and projector,
    which it loads with no missing or unexpected key."""
    text_prefix: str = "model.language_model."
    """Where an export puts the text model's `model.*` tensors (transformers 5's names; lm_head stays as it is)."""
    text_model_type: str = ""
    """The text model's model_type when text_config names none (transformers' config default)."""
    image_token_key: str = "image_token_index"
    """The key naming the image placeholder token's id."""

    @property
    def architecture(self) -> str:
        return self.architectures[0]

    def rayspeed_name(self, stored: str) -> Optional[str]:
        """rayspeed's name of a checkpoint tensor of the image path (None: a text-model tensor)."""
        for prefix, ours in self.stored:
            if stored.startswith(prefix):
                return ours + stored[len(prefix):]
        return None
