"""LLaVA-style parity with transformers (LlavaForConditionalGeneration made locally: a Llama text model after a CLIP
tower under the default strategy, and after a SigLIP tower keeping every position), fp32, rtol = atol = 1e-5: with
images in the batch the logits, the loss and every gradient, the tower's and the projector's included, at tp1, and
each rank's at tp2 with sequence parallelism; the image path changes the logits (so the parity cannot hold with the
images ignored)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from _dist import run_distributed
from _hf_models import shape_of
from _hf_parity import TOL, build, reference_grad

SEQ, BATCH, VOCAB, IMAGE_TOKEN = 16, 2, 256, 255
TEXT = dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=None,
            bos_token_id=None, eos_token_id=None)
CLIP = dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, image_size=28, patch_size=14, projection_dim=16)
SIGLIP = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=2, image_size=28, patch_size=14, vision_use_head=False)
TOWERS = {"clip": (CLIP, "default", 4), "siglip": (SIGLIP, "full", 4)}  # 2 x 2 patches: 4 image tokens either way


def _save(out, tower, strategy, seed=7):
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(LlavaConfig(text_config=TEXT, vision_config=tower,
                                                      image_token_index=IMAGE_TOKEN,
                                                      vision_feature_select_strategy=strategy))
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn(p.shape))
    model.save_pretrained(out)


def _batch(image_tokens):
    """(ids [b, s + 1] with one image's placeholders per row at 2 .., labels' image places ignored, images)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, IMAGE_TOKEN, (BATCH, SEQ + 1), generator=g)
    ids[:, 2:2 + image_tokens] = IMAGE_TOKEN
    labels = ids[:, 1:].clone()
    labels[labels == IMAGE_TOKEN] = -100
    return ids, labels, torch.randn(BATCH, 3, 28, 28, generator=g)


def _theirs(name, shape):
    """transformers' in-memory name of rayspeed parameter `name`."""
    from rayspeed.model.image_weights import image_path_tensors, is_image_path

    if is_image_path(name):
        return next(iter(image_path_tensors({name: None}, shape.image_path)))
    hf = shape.family.tensor_names.hf_name(name)
    return hf if hf.startswith("lm_head.") else "model.language_model." + hf[len("model."):]


def _shape(model_dir):
    return shape_of(str(model_dir), SEQ)  # through the job config: model.pretrained fills model.image_path


@pytest.fixture(scope="module", params=sorted(TOWERS))
def llava(request, tmp_path_factory):
    from transformers import LlavaForConditionalGeneration

    tower, strategy, image_tokens = TOWERS[request.param]
    d = tmp_path_factory.mktemp(f"llava-{request.param}") / "m"
    _save(d, tower, strategy)
    model = LlavaForConditionalGeneration.from_pretrained(str(d), dtype=torch.float32).eval()
    ids, labels, images = _batch(image_tokens)
    logits = model(input_ids=ids[:, :-1], pixel_values=images).logits.float()
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"dir": d, "ids": ids, "labels": labels, "images": images, "logits": logits.detach(),
            "loss": loss.detach(), "grads": grads, "shape": _shape(d)}


def test_the_shape_reads_the_image_path(llava):
    shape = llava["shape"]
    assert shape.architecture == "LlamaForCausalLM" and shape.image_path.image_token_id == IMAGE_TOKEN
    assert shape.image_path.image_tokens == 4 and shape.image_path.feature_layer == -2


def test_tp1_logits_loss_and_every_gradient_match_transformers(llava):
    shape = llava["shape"]
    model = build(shape, str(llava["dir"]))
    ids, images = llava["ids"][:, :-1], {"pixel_values": llava["images"]}
    with torch.no_grad():
        torch.testing.assert_close(model(ids, inputs=images), llava["logits"], **TOL)
    loss = model(ids, llava["labels"], inputs=images)
    torch.testing.assert_close(loss.detach(), llava["loss"], **TOL)
    loss.backward()
    names = {n: _theirs(n, shape) for n, p in model.named_parameters() if p.grad is not None}
    # The tower's layers after the feature layer, and its last norm, feed nothing (in transformers neither).
    assert set(names.values()) == set(llava["grads"]), "every trained tensor of transformers' model, once"
    assert any(n.startswith("embed.tower.") for n in names) and any(n.startswith("embed.projector.") for n in names)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, llava["grads"][names[name]], **TOL, msg=lambda m: f"{name}: {m}")


def test_the_images_change_the_logits(llava):
    model = build(llava["shape"], str(llava["dir"]))
    with torch.no_grad():
        other = model(llava["ids"][:, :-1], inputs={"pixel_values": llava["images"].flip(-1)})
    assert (other - llava["logits"]).abs().max() > 1e-3


def test_placeholders_and_images_that_disagree_are_refused(llava):
    model = build(llava["shape"], str(llava["dir"]))
    with pytest.raises(ValueError, match="8 image tokens in the batch but 1 images of 4 features"):
        model(llava["ids"][:, :-1], inputs={"pixel_values": llava["images"][:1]})


def _tp2(rank, world_size, model_dir, ids, labels, images):
    from rayspeed.parallel.groups import ParallelGroups

    shape = _shape(model_dir)
    model = build(shape, str(model_dir), ParallelGroups(dp=1, tp=2, pp=1).tp, sp=True)
    with torch.no_grad():
        logits = model(ids, inputs={"pixel_values": images})
    loss = model(ids, labels, inputs={"pixel_values": images})
    loss.backward()
    return logits, loss.detach(), {n: None if p.grad is None else p.grad.detach().clone()
                                   for n, p in model.named_parameters()}


def test_tp2_sequence_parallel_matches_transformers(llava):
    """Each rank's logits and loss, its text shards' gradients, and the replicated tower's
    and projector's whole gradients."""
    shape = llava["shape"]
    results = run_distributed(_tp2, 2, llava["dir"], llava["ids"][:, :-1], llava["labels"], llava["images"],
                              timeout_s=120)
    for rank, (logits, loss, grads) in enumerate(results):
        torch.testing.assert_close(logits, llava["logits"], **TOL)
        torch.testing.assert_close(loss, llava["loss"], **TOL)
        for name, grad in grads.items():
            if grad is None:
                continue
            theirs = _theirs(name, shape)
            if name.startswith("embed.") and name != "embed.weight":
                expected = llava["grads"][theirs]
            else:
                ref = {"grads": {shape.family.tensor_names.hf_name(name): llava["grads"][theirs]}}
                expected = reference_grad(ref, shape, name, rank, 2)
            torch.testing.assert_close(grad, expected, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("change, message", [
    ({"vision_config": {**CLIP, "model_type": "pixtral"}}, "vision_config.model_type 'pixtral' is not supported for "
     "LlavaForConditionalGeneration; supported: clip_vision_model, siglip_vision_model"),
    ({"vision_feature_layer": [-2, -1]}, "vision_feature_layer [-2, -1]: only one feature layer is supported"),
])
def test_an_image_path_rayspeed_cannot_run_is_named(tmp_path, llava, change, message):
    from rayspeed.config.load import parse
    from rayspeed.errors import ConfigError

    d = tmp_path / "m"
    d.mkdir()
    config = {**json.loads((llava["dir"] / "config.json").read_text()), **change}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse({"model": {"seq_len": SEQ}}, [f"model.pretrained={d}"])


def test_pipeline_and_context_parallelism_are_refused_with_images(llava):
    from rayspeed.config.load import parse
    from rayspeed.errors import ConfigError

    with pytest.raises(ConfigError, match="parallel.pp: 2 with the image path of LlavaForConditionalGeneration is not "
                                          "built yet"):
        parse({"model": {"seq_len": SEQ}}, [f"model.pretrained={llava['dir']}", "parallel.pp=2"])


def test_the_export_is_the_whole_model_transformers_loads_with_the_same_logits(llava, tmp_path):
    """Out again: the trained image path and text model written as one LlavaForConditionalGeneration (no missing
    or unexpected tensor), with rayspeed's logits on images."""
    from transformers import LlavaForConditionalGeneration

    from rayspeed.model.hf_export import write_hf_dir

    shape = llava["shape"]
    model = build(shape, str(llava["dir"])).eval()
    ids, images = llava["ids"][:, :-1], {"pixel_values": llava["images"]}
    with torch.no_grad():
        for name, p in model.named_parameters():  # moved from the checkpoint, the projector and tower too
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
        expected = model(ids, inputs=images)
    write_hf_dir(model.full_state_dict(), shape, str(tmp_path / "hf"), tokenizer=None)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"] and config["text_config"]["model_type"] == \
        "llama" and config["vision_config"]["model_type"] == json.loads(
            (llava["dir"] / "config.json").read_text())["vision_config"]["model_type"]
    hf, info = LlavaForConditionalGeneration.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32,
                                                             output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(input_ids=ids, pixel_values=llava["images"]).logits, expected, **TOL)


def test_the_base_an_adapter_merges_into_holds_the_image_path_and_an_export_without_it_is_refused(llava, tmp_path):
    """An adapter job's checkpoints hold neither the frozen tower nor the text base: the export reads them from
    model.pretrained (read_whole), and weights lacking the image path are refused rather than written without it."""
    from rayspeed.model.hf_export import write_hf_dir
    from rayspeed.model.hf_weights import read_whole

    shape = llava["shape"]
    whole = read_whole(str(llava["dir"]), shape)
    model = build(shape, str(llava["dir"]))
    assert set(whole) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        assert torch.equal(whole[name], p.detach()), name
    text_only = {k: v for k, v in whole.items() if not k.startswith("embed.tower.")}
    with pytest.raises(KeyError, match="the weights lack the image path's embed.tower."):
        write_hf_dir(text_only, shape, str(tmp_path / "hf"))
