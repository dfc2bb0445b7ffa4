"""LLaVA (transformers' LlavaForConditionalGeneration): a CLIP or SigLIP vision tower, the hidden states of one of its
layers (the second to last by default; CLIP's class token dropped under the default strategy), a Linear-GELU-Linear
projector into the text model's width, the projections written over the image placeholder tokens, then the text model
of text_config (any family rayspeed reads), causal throughout (model/families/llava_vision.py)."""

from __future__ import annotations

from rayspeed.families.family import frozen
from rayspeed.families.vision import PROJECTOR_PREFIX, SELECT_DEFAULT, TOWER_PREFIX, VisionLanguage

VISION = VisionLanguage(
    architectures=("LlavaForConditionalGeneration",), model_type="llava", text_model_type="llama",
    towers=frozen({"clip_vision_model": True, "siglip_vision_model": False}),
    keys=frozen({"image_token_index": 32000, "vision_feature_layer": -2,
                 "vision_feature_select_strategy": SELECT_DEFAULT, "projector_hidden_act": "gelu",
                 "multimodal_projector_bias": True}),
    # The hub's llava-1.5 (transformers 4: vision_tower.vision_model.*), what transformers 5.24 saves
    # (vision_tower.*) and its in-memory names (model.vision_tower.*); the tower's own names are 5.24's.
    stored=(("model.vision_tower.vision_model.", TOWER_PREFIX), ("vision_tower.vision_model.", TOWER_PREFIX),
            ("model.vision_tower.", TOWER_PREFIX), ("vision_tower.", TOWER_PREFIX),
            ("model.multi_modal_projector.", PROJECTOR_PREFIX), ("multi_modal_projector.", PROJECTOR_PREFIX)),
    written=((TOWER_PREFIX, "model.vision_tower."), (PROJECTOR_PREFIX, "model.multi_modal_projector.")))
