"""Gemma 3 (text) parity with transformers (Gemma3ForCausalLM made locally: local layers with a window of 5 and
their own RoPE base, a global layer with linear RoPE scaling, four (1 + w) norms per block, per-head q/k norms,
GeGLU, the scaled embedding, query_pre_attn_scalar, tied embeddings), fp32, rtol = atol = 1e-5: logits, loss and
every parameter's gradient at tp1; a packed row of two documents longer than the window, each equal to
transformers on that document alone; at tp2 with sequence parallelism each rank's logits, loss and every gradient
shard; at pp2 (DeepSpeed's pipeline) the last stage's logits and every stage's loss; and the export loads back as
a Gemma3ForCausalLM with rayspeed's logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _dist import run_distributed
from _hf_models import GEMMA3, save, shape_of
from _hf_parity import (
    TOL,
    assert_pp2_gradients,
    assert_rank_matches,
    assert_tp1_matches,
    build,
    init_deepspeed_gloo,
    reference,
    tokens,
    tp2_and_pp2,
)

SEQ, BATCH = 16, 2


def _tokens(vocab, seed=5):
    return tokens(vocab, BATCH, SEQ, seed)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3") / "m"
    save(d, GEMMA3, seed=17)
    ref = reference(str(d), _tokens(GEMMA3["vocab"]))
    model = ref["model"]
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert model.config.layer_types == GEMMA3["layer_types"] and model.config.sliding_window == 5
    return ref


def test_the_shape_is_gemma3s(gemma3):
    shape = shape_of(gemma3["dir"], SEQ)
    assert (shape.architecture, shape.head_dim, shape.q_dim, shape.tie_embeddings) == ("Gemma3ForCausalLM", 16, 64,
                                                                                       True)
    assert (shape.sliding_window, shape.layer_types) == (5, tuple(GEMMA3["layer_types"]))
    assert (shape.rope_local_theta, shape.rope_type, shape.query_pre_attn_scalar, shape.hidden_act) == (
        100.0, "linear", 256.0, "gelu_pytorch_tanh")
    assert [shape.window_of(i) for i in range(3)] == [5, None, 5]
    model = build(shape, gemma3["dir"])
    assert sum(p.numel() for p in model.parameters()) == shape.params  # four norms per block and the q/k norms


def test_tp1_logits_loss_and_gradients_match_transformers(gemma3):
    shape = shape_of(gemma3["dir"], SEQ)
    assert_tp1_matches(build(shape, gemma3["dir"]), gemma3, shape, _tokens(shape.vocab_size))


@pytest.mark.parametrize("change", [dict(sliding_window=None), dict(rope_local_theta=None),
                                    dict(query_pre_attn_scalar=None)])
def test_the_window_the_local_rope_base_and_the_scale_each_change_the_logits(gemma3, change):
    """Each of them matters at this size, so the parity above cannot pass with one of them ignored."""
    shape = dataclasses.replace(shape_of(gemma3["dir"], SEQ), **change)
    with torch.no_grad():
        logits = build(shape, gemma3["dir"])(_tokens(shape.vocab_size)[:, :-1])
    assert (logits - gemma3["logits"]).abs().max() > 1e-3


def test_a_packed_row_of_documents_longer_than_the_window_equals_each_alone(gemma3):
    shape = shape_of(gemma3["dir"], SEQ)
    model = build(shape, gemma3["dir"])
    hf = gemma3["model"]
    ids = _tokens(shape.vocab_size)[:1, :SEQ]
    lens = (7, 9)  # both longer than the window: the local layers slide inside each document
    segments = torch.cat([torch.full((n,), k) for k, n in enumerate(lens)])[None]
    with torch.no_grad():
        packed = model(ids, segment_ids=segments)
        start = 0
        for n in lens:
            alone = hf(ids[:, start:start + n]).logits.float()
            torch.testing.assert_close(packed[:, start:start + n], alone, **TOL)
            start += n


def _ranks(rank, world_size, model_dir):
    init_deepspeed_gloo()
    shape = shape_of(model_dir, SEQ)
    return tp2_and_pp2(shape, model_dir, _tokens(shape.vocab_size))


def test_tp2_sequence_parallel_and_pp2_match_transformers(gemma3):
    shape = shape_of(gemma3["dir"], SEQ)
    results = run_distributed(_ranks, 2, gemma3["dir"], timeout_s=120)
    for rank, result in enumerate(results):
        assert_rank_matches(result, rank, gemma3, shape)
    assert_pp2_gradients([r[3][2] for r in results], gemma3, shape)


def test_a_gemma3_written_as_hf_loads_in_transformers_with_the_same_logits(tmp_path, gemma3):
    """Out again: the checkpoint's model with its norms moved, written in Hugging Face format, is a
    Gemma3ForCausalLM (same windows, layer types, RoPE bases and scale) with rayspeed's logits."""
    import json

    from transformers import AutoModelForCausalLM

    from rayspeed.model.hf_export import write_hf_dir

    shape = shape_of(gemma3["dir"], SEQ)
    model = build(shape, gemma3["dir"]).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
        ids = _tokens(256)[:, :-1]
        expected = model(ids)
    write_hf_dir(model.full_state_dict(), shape, str(tmp_path / "hf"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["architectures"], cfg["model_type"], cfg["layer_types"]) == (
        ["Gemma3ForCausalLM"], "gemma3_text", GEMMA3["layer_types"])
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits.float(), expected, **TOL)


def test_the_published_multimodal_form_trains_its_text_model_and_exports_it_alone(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (text + a tiny SigLIP tower, saved by transformers in the hub's
    `language_model.model.*` naming): rayspeed reads its text_config, loads only the text weights, equals
    transformers' multimodal model on text, and exports a Gemma3ForCausalLM with the same logits."""
    import json

    from transformers import AutoModelForCausalLM, Gemma3Config, Gemma3ForConditionalGeneration

    from rayspeed.model.hf_export import write_hf_dir

    text = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=5, max_position_embeddings=64,
                layer_types=["sliding_attention", "full_attention"], pad_token_id=None, bos_token_id=None,
                eos_token_id=None)
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(3)
    mm = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                     image_token_index=255, boi_token_index=253,
                                                     eoi_token_index=254)).eval()
    with torch.no_grad():
        for name, p in mm.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape))
    d = tmp_path / "mm"
    mm.save_pretrained(d)
    assert json.loads((d / "config.json").read_text())["architectures"] == ["Gemma3ForConditionalGeneration"]
    shape = shape_of(str(d), SEQ)
    assert (shape.architecture, shape.layer_types, shape.head_dim) == (
        "Gemma3ForCausalLM", ("sliding_attention", "full_attention"), 16)
    model = build(shape, str(d)).eval()
    ids = _tokens(256)[:, :-1] % 253  # text tokens only: no image or image-boundary ids
    with torch.no_grad():
        expected = mm(input_ids=ids).logits.float()
        torch.testing.assert_close(model(ids), expected, **TOL)
    write_hf_dir(model.full_state_dict(), shape, str(tmp_path / "text"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "text"), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits.float(), expected, **TOL)
