"""The image path's shape, read from a vision-language config.json (torch-free): which tower (its config.json section,
kept whole: the tower is transformers' own module built from it), which of its layers feeds the projector, the
projector's activation and biases, the image placeholder token, and how many tokens one image becomes.

    vision, problems = vision_shape_from_hf(config_json, "model.pretrained: /models/llava/config.json")
    vision.image_tokens          # placeholder tokens per image (576 for llava-1.5: 24 x 24 patches)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from rayspeed import families
from rayspeed.families.vision import SELECT_DEFAULT, SELECT_FULL, VisionLanguage

PROJECTOR_ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "silu", "relu")


@dataclass
class VisionTraining:
    """model.vision: what of a vision-language model's image path trains (the text model trains as the job says:
    in full, or through adapters)."""
    train_tower: bool = False
    """Train the vision tower too (by default it stays as loaded: it was trained on far more images)."""
    train_projector: bool = True
    """Train the projector in full, with adapters on the text model too (the common recipe)."""


@dataclass(frozen=True)
class VisionShape:
    architecture: str
    """The vision-language architecture (LlavaForConditionalGeneration)."""
    tower_json: str
    """config.json's vision_config, as sorted JSON (hashable, what builds the tower)."""
    image_token_id: int
    """The placeholder token each image's features replace, one per feature."""
    feature_layer: int
    """The tower's hidden states that feed the projector (transformers' index: -2, the second to last layer)."""
    select_strategy: str = SELECT_DEFAULT
    """default: drop the tower's class token, where it has one; full: keep every position."""
    projector_act: str = "gelu"
    projector_bias: bool = True

    @property
    def record(self) -> VisionLanguage:
        found = families.vision_language(self.architecture)
        assert found is not None, self.architecture  # vision_shape_from_hf made it from a record's architecture
        return found

    @property
    def tower(self) -> dict[str, Any]:
        return dict(json.loads(self.tower_json))

    @property
    def tower_hidden(self) -> int:
        return int(self.tower["hidden_size"])

    @property
    def class_token(self) -> bool:
        return bool(self.record.towers[str(self.tower["model_type"])])

    @property
    def image_tokens(self) -> int:
        """Tokens one image becomes: the tower's patches, its class token too under `full`."""
        t = self.tower
        patches = (int(t.get("image_size", 224)) // int(t.get("patch_size", 16))) ** 2
        return patches + int(self.class_token and self.select_strategy == SELECT_FULL)


def vision_shape_from_hf(hf: dict[str, Any], where: str) -> tuple[Optional[VisionShape], list[str]]:
    """The image path of a vision-language config.json (None for any other), and what rayspeed cannot run of it."""
    archs = hf.get("architectures") or []
    record = families.vision_language(str(archs[0])) if archs else None
    if record is None:
        return None, []
    keys = {k: hf.get(k, default) for k, default in record.keys.items()}
    problems = []
    tower = hf.get("vision_config")
    kind = tower.get("model_type") if isinstance(tower, dict) else None
    if kind not in record.towers:
        problems.append(f"{where}: vision_config.model_type {kind!r} is not supported for {record.architecture}; "
                        f"supported: {', '.join(record.towers)}")
    layer = keys["vision_feature_layer"]
    if not isinstance(layer, int):
        problems.append(f"{where}: vision_feature_layer {layer!r}: only one feature layer is supported (a list "
                        "concatenates several)")
    if keys["vision_feature_select_strategy"] not in (SELECT_DEFAULT, SELECT_FULL):
        problems.append(f"{where}: vision_feature_select_strategy {keys['vision_feature_select_strategy']!r} is not "
                        f"{SELECT_DEFAULT} or {SELECT_FULL}")
    if keys["projector_hidden_act"] not in PROJECTOR_ACTIVATIONS:
        problems.append(f"{where}: projector_hidden_act {keys['projector_hidden_act']!r} is not supported; "
                        f"supported: {', '.join(PROJECTOR_ACTIVATIONS)}")
    if problems:
        return None, problems
    return VisionShape(architecture=record.architecture, tower_json=json.dumps(tower, sort_keys=True),
                       image_token_id=int(hf.get("image_token_id", keys[record.image_token_key])),
                       feature_layer=int(layer), select_strategy=str(keys["vision_feature_select_strategy"]),
                       projector_act=str(keys["projector_hidden_act"]),
                       projector_bias=bool(keys["multimodal_projector_bias"])), []


def vision_language_config(vision: VisionShape, text: dict[str, Any]) -> dict[str, Any]:
    """config.json of the whole vision-language model: `text` (the text model's own config.json) as its
    text_config, the tower's vision_config, and the keys that join them."""
    record = vision.record
    inner = {k: v for k, v in text.items() if k not in ("architectures", "dtype")}
    return {"architectures": [record.architecture], "model_type": record.model_type, "text_config": inner,
            "vision_config": vision.tower, record.image_token_key: vision.image_token_id,
            "vision_feature_layer": vision.feature_layer, "vision_feature_select_strategy": vision.select_strategy,
            "projector_hidden_act": vision.projector_act, "multimodal_projector_bias": vision.projector_bias,
            "image_seq_length": vision.image_tokens, "tie_word_embeddings": bool(text.get("tie_word_embeddings")),
            "dtype": text.get("dtype", "float32")}
