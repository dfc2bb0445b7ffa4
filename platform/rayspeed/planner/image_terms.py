"""What a vision-language model's image path (model.image_path: a ViT tower and a projector before the text model)
adds to a step's memory and time (docs/PLANNER.md, "Images").

- Its weights, on the first pipeline stage (the input stage's), replicated over tp: the tower's (a ViT: per layer
  q, k, v, o with biases, a two-matrix MLP with biases, two layer norms; the patch embedding, the positions, the class
  token, the norms around the encoder) and the projector's (two matrices with biases). What trains (the projector by
  default, the tower with model.vision.train_tower) also holds its gradient and fp32 master weights and Adam moments,
  counted whole on every rank (not divided by ZeRO: an upper bound, small beside the text model's).
- Activations: the images of a micro-batch go through the tower at once. A frozen tower keeps nothing for backward
  (no parameter or input needs a gradient): one layer's working set; a trained tower keeps every layer's, as a
  transformer block's (the field guide's ~34 h bytes per token in half precision, without recomputation).
- Time: a tower forward of 2 x tower parameters FLOPs per image position, x3 when the tower trains (its backward),
  at the GEMM efficiency; the projector's likewise, at the image tokens. Images per micro-batch: at most
  seq_len / image tokens per sequence (every token an image's: the bound the planner must assume).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rayspeed.planner.terms import MemoryTerm, TimeTerm, register

ADAM_STATE_BYTES = 4 + 4 + 4  # fp32 master weights, Adam's two moments
BLOCK_ACTIVATION_BYTES_PER_H = 34  # per token of a transformer block in half precision (Korthikanti et al. 2022)


@dataclass(frozen=True)
class ImagePlan:
    tower_params: int
    projector_params: int
    train_tower: bool
    train_projector: bool
    positions: int  # tower positions per image (patches, and the class token)
    image_tokens: int  # text tokens per image
    tower_hidden: int
    tower_ffn: int
    tower_layers: int
    pixel_bytes: int  # one cached image (uint8)

    @classmethod
    def of(cls, cfg: Any) -> Optional["ImagePlan"]:
        vision = getattr(cfg.model, "image_path", None)
        if vision is None:
            return None
        t = vision.tower
        h, ffn, layers = int(t["hidden_size"]), int(t["intermediate_size"]), int(t["num_hidden_layers"])
        channels, size, patch = int(t.get("num_channels", 3)), int(t.get("image_size", 224)), int(t.get("patch_size",
                                                                                                           16))
        positions = (size // patch) ** 2 + int(vision.class_token)
        per_layer = 4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h
        tower = layers * per_layer + channels * patch * patch * h + positions * h + h * int(vision.class_token) + 4 * h
        text_h = int(cfg.model.hidden_size)
        projector = vision.tower_hidden * text_h + text_h * text_h + (2 * text_h if vision.projector_bias else 0)
        train = cfg.model.vision
        return cls(tower_params=tower, projector_params=projector, train_tower=bool(train.train_tower),
                   train_projector=bool(train.train_projector), positions=positions, image_tokens=vision.image_tokens,
                   tower_hidden=h, tower_ffn=ffn, tower_layers=layers, pixel_bytes=channels * size * size)

    @property
    def trained_params(self) -> int:
        return self.tower_params * self.train_tower + self.projector_params * self.train_projector


def images_per_micro_batch(ctx: Any, lay: Any) -> int:
    return lay.micro_batch_size * max(1, ctx.shape.seq_len // max(1, ctx.image.image_tokens))


def weight_bytes(ctx: Any, lay: Any, stage: int) -> float:
    im = ctx.image
    if stage != 0:
        return 0.0
    states = im.trained_params * (ctx.w_bytes + ADAM_STATE_BYTES)  # gradients, master weights, moments
    return (im.tower_params + im.projector_params) * ctx.w_bytes + states


def activation_bytes(ctx: Any, lay: Any, stage: int) -> float:
    im = ctx.image
    if stage != 0:
        return 0.0
    tokens = images_per_micro_batch(ctx, lay) * im.positions
    layers = im.tower_layers if im.train_tower else 1
    per_token = BLOCK_ACTIVATION_BYTES_PER_H * im.tower_hidden * ctx.w_bytes / 2  # the constant is in half precision
    return tokens * per_token * layers


def step_s(ctx: Any, lay: Any) -> float:
    im = ctx.image
    images = images_per_micro_batch(ctx, lay) * lay.grad_accum
    tower = 2 * im.tower_params * im.positions * (3 if im.train_tower else 1)
    projector = 2 * im.projector_params * im.image_tokens * (3 if im.train_projector else 1)
    return images * (tower + projector) / (ctx.hw.peak(ctx.precision) * ctx.hw.gemm_efficiency)


def _images(ctx: Any, lay: Any) -> bool:
    return ctx.image is not None


register(MemoryTerm("image_path_weights", applies=_images, bytes=weight_bytes, dynamic=False,
                    source="docs/PLANNER.md Images: the tower's and projector's weights on stage 0, what trains "
                           "with its gradient and Adam state"))
register(MemoryTerm("image_path_activations", applies=_images, bytes=activation_bytes,
                    source="docs/PLANNER.md Images: a micro-batch's images through the tower (one layer's when "
                           "frozen, every layer's when trained)"))
register(TimeTerm("image_path_s", applies=_images, seconds=step_s, kind="compute",
                  source="docs/PLANNER.md Images: 2 x parameters FLOPs per position (x3 when trained) at the GEMM "
                         "efficiency"))
