"""A vision-language model's input stage: the token embeddings, with each image's features, projected into the text
model's width, written over its placeholder tokens (one token per feature, in order), as transformers' LLaVA-style
models merge them. A family's composition names the projector; the tower is transformers' own module built from the
checkpoint's vision_config (the same function by construction; its weights are loaded like every other).

    stage = LlavaInput.build(dims, tp, sequence_parallel, seed, scale)
    hidden = stage(input_ids, pixel_values=images)       # images [n, channels, height, width], n = the ids' images
    hidden = stage(input_ids)                            # a text-only batch: the token embeddings alone

Under tensor parallelism the tower and the projector are replicated (every rank computes the same features: they are
small next to the text model, and the merge needs every feature on every rank); the embedding is all-reduced whole
and then, under sequence parallelism, each rank keeps its part of the sequence, so every rank's features receive the
whole sequence's gradient and the replicas stay equal. Context parallelism would hand each rank part of an image's
tokens: not built (the config refuses it).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from rayspeed.config.shape import ModelShape
from rayspeed.config.vision_shape import VisionShape
from rayspeed.families.vision import SELECT_DEFAULT
from rayspeed.model.parts.input_stage import TokenInput
from rayspeed.parallel.comm import SEQ_DIM, reduce_from_tp, split_to_sequence
from rayspeed.parallel.groups import TensorParallel
from rayspeed.parallel.layers import stable_seed


def build_tower(vision: VisionShape) -> nn.Module:
    """transformers' vision model of the checkpoint's vision_config (CLIPVisionModel, SiglipVisionModel)."""
    from transformers import AutoConfig, AutoModel

    config = dict(vision.tower)
    kind = config.pop("model_type")
    return AutoModel.from_config(AutoConfig.for_model(kind, **config))


class ImageTextInput(TokenInput):
    """Token embeddings with the images' projected features at their placeholders."""
    projector_class: type[nn.Module]
    """The family's projector: built as projector_class(vision, text hidden size), applied to the tower's
    selected hidden states [images, tokens, tower hidden] -> [images, tokens, hidden]."""

    tower: nn.Module
    projector: nn.Module
    vision: VisionShape

    @classmethod
    def build(cls, dims: ModelShape, tp: TensorParallel, sequence_parallel: bool, seed: int,
              scale: Optional[float]) -> "TokenInput":
        stage = super().build(dims, tp, sequence_parallel, seed, scale)
        assert isinstance(stage, ImageTextInput) and dims.image_path is not None  # decoder_pieces picks this stage so
        stage.vision = dims.image_path
        # Initial weights from the seed alone, so every rank and layout starts the same (a checkpoint then
        # overwrites them).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stable_seed(seed, "embed.image_path"))
            stage.tower = build_tower(dims.image_path)
            stage.projector = cls.projector_class(dims.image_path, dims.hidden_size)
        return stage

    def forward(self, input_ids: Any, **inputs: Any) -> Any:
        if isinstance(input_ids, tuple):
            ids, where = input_ids
            return self.forward(ids, **inputs), where
        pixel_values, rows = inputs.pop("pixel_values", None), inputs.pop("image_rows", None)
        if inputs:
            raise TypeError(f"an image-text input stage takes token ids, pixel_values and image_rows, not "
                            f"{sorted(inputs)}")
        if pixel_values is None:
            return super().forward(input_ids)
        x = self.scaled(reduce_from_tp(self.partial(input_ids), self.tp))
        x = self.with_images(x, input_ids == self.vision.image_token_id, pixel_values, rows)
        return split_to_sequence(x, self.tp, SEQ_DIM) if self.sequence_parallel else x

    def with_images(self, x: torch.Tensor, at: torch.Tensor, pixel_values: torch.Tensor,
                    rows: Optional[torch.Tensor]) -> torch.Tensor:
        """The embeddings with the features written over the placeholders (`at`, in order). rows [images, 2]: each
        image's features [lo, hi) that fall in the batch (a window that cuts an image holds part of it); None: all
        of them. A batch without images runs the path on one blank image, times zero, so the trained parameters get
        a gradient (zero) in every step on every rank."""
        if pixel_values.shape[0] == 0:
            t = self.vision.tower
            blank = x.new_zeros(1, int(t.get("num_channels", 3)), int(t["image_size"]), int(t["image_size"]))
            return x + self.image_features(blank).sum().to(x.dtype) * 0.0
        features = self.image_features(pixel_values)
        if rows is None:
            flat = features.reshape(-1, features.shape[-1])
        else:
            flat = torch.cat([features[i, lo:hi] for i, (lo, hi) in enumerate(rows.tolist())])
        if int(at.sum()) != flat.shape[0]:
            raise ValueError(f"{int(at.sum())} image tokens in the batch but {features.shape[0]} images of "
                             f"{flat.shape[0]} features in all")
        return x.masked_scatter(at.unsqueeze(-1), flat.to(x.dtype))

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, tokens per image, hidden]: the chosen layer's hidden states, projected."""
        dtype = next(self.tower.parameters()).dtype
        states = self.tower(pixel_values.to(dtype), output_hidden_states=True).hidden_states
        selected = states[self.vision.feature_layer]
        if self.vision.select_strategy == SELECT_DEFAULT:
            selected = selected[:, 1:]  # transformers drops the first position under `default`, any tower
        return self.projector(selected)
