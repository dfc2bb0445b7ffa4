"""LLaVA's image path (transformers' LlavaForConditionalGeneration): the tower's chosen hidden states through a
Linear-activation-Linear projector, replicated under tensor parallelism (rayspeed.model.parts.image_input)."""

from __future__ import annotations

import torch
import torch.nn as nn

from rayspeed.config.vision_shape import VisionShape
from rayspeed.families import llava
from rayspeed.model.families import VisionComposition
from rayspeed.model.parts.image_input import ImageTextInput


class LlavaProjector(nn.Module):
    def __init__(self, vision: VisionShape, hidden_size: int):
        from transformers.activations import ACT2FN

        super().__init__()
        self.linear_1 = nn.Linear(vision.tower_hidden, hidden_size, bias=vision.projector_bias)
        self.act = ACT2FN[vision.projector_act]
        self.linear_2 = nn.Linear(hidden_size, hidden_size, bias=vision.projector_bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaInput(ImageTextInput):
    projector_class = LlavaProjector


VISION_MODEL = VisionComposition(records=(llava.VISION,), input_stage=LlavaInput)
