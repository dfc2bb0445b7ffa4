"""The planner's image path (planner/image_terms.py) against the real modules: the tower's parameter count equals
transformers' CLIPVisionModel built from the same vision_config (the tiny example's and llava-1.5's CLIP-L/336 on the
meta device), the projector's equals LlavaMultiModalProjector's; a trained tower costs its activations, gradients and
states and three times its forward, a frozen one neither."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

CLIP_L_336 = dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                  num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    import make_tiny_vision_model

    return make_tiny_vision_model.save(str(tmp_path_factory.mktemp("tiny-vision")), seed=0)


def _cfg(model_dir, *sets):
    from rayspeed.config.load import parse

    return parse({"name": "v", "model": {"seq_len": 108}, "cluster": {"num_workers": 2}},
                 [f"model.pretrained={model_dir}", *sets])


def _counts(config_json):
    from transformers import AutoConfig, AutoModel, LlavaConfig
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    tower = dict(config_json["vision_config"])
    kind = tower.pop("model_type")
    with torch.device("meta"):
        t = AutoModel.from_config(AutoConfig.for_model(kind, **tower))
        p = LlavaMultiModalProjector(LlavaConfig(**{k: v for k, v in config_json.items() if k != "architectures"}))
    return sum(x.numel() for x in t.parameters()), sum(x.numel() for x in p.parameters())


def test_the_tower_and_projector_counts_equal_transformers_modules(example, tmp_path):
    from rayspeed.planner.image_terms import ImagePlan

    config = json.loads(open(os.path.join(example["model"], "config.json")).read())
    plan = ImagePlan.of(_cfg(example["model"]))
    assert (plan.tower_params, plan.projector_params) == _counts(config)
    assert (plan.positions, plan.image_tokens, plan.pixel_bytes) == (17, 16, 3 * 32 * 32)

    big = {**config, "vision_config": CLIP_L_336}  # llava-1.5's tower over the same text model
    from rayspeed.config.vision_shape import vision_shape_from_hf

    vision, problems = vision_shape_from_hf(big, "config.json")
    assert not problems and vision.image_tokens == 576
    cfg = _cfg(example["model"])
    cfg.model.image_path = vision
    plan = ImagePlan.of(cfg)
    assert (plan.tower_params, plan.projector_params) == _counts(big)
    assert plan.tower_params == 303_507_456  # CLIP ViT-L/14-336's vision model


def test_a_trained_tower_costs_its_states_activations_and_backward(example):
    from rayspeed.config.layout import Layout
    from rayspeed.planner.image_terms import activation_bytes, step_s, weight_bytes
    from rayspeed.planner.search import build_ctx

    frozen = build_ctx(_cfg(example["model"]))
    trained = build_ctx(_cfg(example["model"], "model.vision.train_tower=true"))
    lay = Layout(dp=2, tp=1, pp=1, zero_stage=2, micro_batch_size=2, grad_accum=2)
    im = frozen.image
    assert weight_bytes(trained, lay, 0) - weight_bytes(frozen, lay, 0) == im.tower_params * (4 + 12)
    assert activation_bytes(trained, lay, 0) == activation_bytes(frozen, lay, 0) * im.tower_layers
    images = 2 * (108 // 16) * 2  # micro-batch 2, 6 images a sequence at most, accumulation 2
    tower = 2 * im.tower_params * im.positions * (3 - 1) * images / (frozen.hw.peak(frozen.precision)
                                                                     * frozen.hw.gemm_efficiency)
    assert step_s(trained, lay) - step_s(frozen, lay) == pytest.approx(tower)
    assert weight_bytes(frozen, lay, 1) == 0.0  # only the first pipeline stage holds the image path
