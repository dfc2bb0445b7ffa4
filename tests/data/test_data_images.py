"""Chat records with images, through the job's own data path (model.pretrained a tiny LLaVA with its processor,
scripts/make_tiny_vision_model.py): each record's tokens equal what the checkpoint's LlavaProcessor makes of the
rendered conversation and its image (the placeholder repeated to one token per feature), only the assistant turn is
trained on, the cached uint8 images normalise to the processor's pixel values; a training window that cuts an image
hands the model exactly the rows of its features that fall inside, and the model then equals transformers on the
whole records; TRL's `images` column and data URIs read the same images; a missing image and a video part are named.
"""

from __future__ import annotations

import base64
import json
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

SEQ = 64


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    import make_tiny_vision_model

    out = tmp_path_factory.mktemp("tiny-vision")
    made = make_tiny_vision_model.save(str(out), seed=0)
    return {**made, "out": out}


def _cfg(example, path, seq=SEQ):
    from rayspeed.config.load import parse

    return parse({"name": "v", "model": {"seq_len": seq},
                  "data": {"source": "files", "path": str(path), "format": "chat", "tokenizer": "model"}},
                 [f"model.pretrained={example['model']}"])


def _shards(example, path, tmp_path, seq=SEQ):
    from rayspeed.data.shards import ShardSet
    from rayspeed.data.tokenization import build_shards
    from rayspeed.train.data_setup import data_spec

    index, _ = build_shards(data_spec(_cfg(example, path, seq)), str(tmp_path / "cache"))
    return ShardSet([os.path.join(index["dir"], s["name"]) for s in index["shards"]])


def _processor_view(example, record):
    """(input_ids, pixel_values) as the checkpoint's own processor makes them from the record."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(example["model"])
    messages = [{**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]}
                for m in record["messages"]]
    text = processor.apply_chat_template(messages, tokenize=False)
    image = Image.open(os.path.join(example["shapes"], record["messages"][0]["content"][0]["path"])).convert("RGB")
    out = processor(text=text, images=[image], return_tensors="np")
    return out["input_ids"][0], out["pixel_values"][0]


def test_tokens_mask_and_pixels_equal_the_checkpoints_processor(example, tmp_path):
    shards = _shards(example, os.path.join(example["shapes"], "train.jsonl"), tmp_path)
    records = [json.loads(line) for line in open(os.path.join(example["shapes"], "train.jsonl"))][:5]
    table = shards.images
    assert table.tokens == 16 and table.at.size == 400
    for d, record in enumerate(records):
        ids, pixels = _processor_view(example, record)
        a, b = int(shards.doc_starts[d]), int(shards.doc_starts[d + 1])
        np.testing.assert_array_equal(np.asarray(shards.tokens[a:b]), ids)
        assert int(table.at[d]) == a + int(np.flatnonzero(ids == example["image_token_id"])[0])
        np.testing.assert_allclose(table.normalized(d), pixels, rtol=0, atol=1e-6)
        mask = np.asarray(shards.mask[a:b])
        answer = record["messages"][1]["content"][0]["text"]
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(example["model"])
        assert tok.decode(ids[mask.astype(bool)]) == answer + "<|eot_id|>"  # the answer and its end of turn alone


def test_a_window_that_cuts_an_image_gets_the_features_inside_and_equals_transformers(example, tmp_path):
    """Packed windows of 50 inputs over records of 36 tokens: window 0 holds record 0 whole and record 1's image in
    part (rows 0..7 of its 16); the model's logits over record 0 equal LlavaForConditionalGeneration's on record 0
    alone, and its input embeddings at the cut image equal transformers' rows of record 1's image."""
    from transformers import LlavaForConditionalGeneration

    from rayspeed.config.shape import ModelShape
    from rayspeed.data.batches import make_batch
    from rayspeed.data.token_split import TokenSplit
    from rayspeed.model.hf_weights import load_hf_weights
    from rayspeed.model.transformer import Transformer
    from rayspeed.parallel.layers import deferred_init

    seq = 50
    shards = _shards(example, os.path.join(example["shapes"], "train.jsonl"), tmp_path, seq)
    split = TokenSplit(shards.tokens, 0, len(shards.tokens), mask=shards.mask, doc_starts=shards.doc_starts,
                       store=shards)
    batch = make_batch(split, np.array([0, 1]), seq)
    rows = batch.inputs["image_rows"].tolist()
    assert rows[:2] == [[0, 16], [0, 8]] and batch.windows.tolist()[:2] == [0, 0]  # record 1's image cut at 8
    shape = ModelShape.from_config(_cfg(example, os.path.join(example["shapes"], "train.jsonl"), seq).model)
    with deferred_init():
        model = Transformer(shape)
    load_hf_weights(model, example["model"], shape)
    hf = LlavaForConditionalGeneration.from_pretrained(example["model"], dtype=torch.float32).eval()
    with torch.no_grad():
        ours = model(batch[0], inputs=batch.inputs)
        ids = batch[0][:1, :36]
        pixels = batch.inputs["pixel_values"][:1]
        torch.testing.assert_close(ours[:1, :36], hf(input_ids=ids, pixel_values=pixels).logits, rtol=1e-5,
                                   atol=1e-5)
        embeds = model.embed(batch[0], pixel_values=batch.inputs["pixel_values"],
                             image_rows=batch.inputs["image_rows"])
        whole = hf.model.get_image_features(pixel_values=batch.inputs["pixel_values"][1:2],
                                            vision_feature_layer=-2,
                                            vision_feature_select_strategy="default").pooler_output[0]
        torch.testing.assert_close(embeds[0, 42:50], whole[:8], rtol=1e-5, atol=1e-5)


def test_trls_images_column_and_a_data_uri_read_the_same_image(example, tmp_path):
    record = json.loads(open(os.path.join(example["shapes"], "train.jsonl")).readline())
    path = os.path.join(example["shapes"], record["messages"][0]["content"][0]["path"])
    uri = "data:image/png;base64," + base64.b64encode(open(path, "rb").read()).decode()
    trl = {"messages": [{**record["messages"][0], "content": [{"type": "image"}, record["messages"][0]["content"][1]]},
                        record["messages"][1]], "images": [path]}
    inline = {"messages": [{**record["messages"][0], "content": [{"type": "image", "image": uri},
                                                                 record["messages"][0]["content"][1]]},
                           record["messages"][1]]}
    data = tmp_path / "forms.jsonl"
    data.write_text(json.dumps(trl) + "\n" + json.dumps(inline) + "\n")
    shards = _shards(example, data, tmp_path)
    np.testing.assert_array_equal(shards.images.normalized(0), shards.images.normalized(1))
    np.testing.assert_allclose(shards.images.normalized(0), _processor_view(example, record)[1], atol=1e-6)


@pytest.mark.parametrize("part, message", [
    ({"type": "image", "path": "img/missing.png"}, r"bad.jsonl:1: image .*img/missing.png cannot be read"),
    ({"type": "video", "path": "clip.mp4"}, r"bad.jsonl:1: message 0 part 0 is a video: not supported yet"),
])
def test_a_missing_image_or_a_video_is_named_with_its_record(example, tmp_path, part, message):
    from rayspeed.errors import ConfigError

    record = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "What colour?"}]},
                           {"role": "assistant", "content": "red"}]}
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(record) + "\n")
    with pytest.raises(ConfigError, match=message):
        _shards(example, data, tmp_path)
    cache = tmp_path / "cache"
    assert not cache.exists() or not any(n.startswith("shards-") for n in os.listdir(cache))  # nothing committed
