"""Make the image fine-tuning example, locally (nothing is downloaded): a tiny LLaVA-style checkpoint with its own
tokenizer, chat template and image processor, and chat records about pictures of coloured shapes.

    python scripts/make_tiny_vision_model.py [OUT]      # default runs/examples/tiny-vision in the repository

OUT/model/   LlavaForConditionalGeneration: a CLIP vision tower (32 x 32 images, 8 x 8 patches: 16 image tokens,
             the class token dropped), a Linear-GELU-Linear projector and a Llama text model (hidden 64, 2 layers),
             transformers' own initialisation, saved with save_pretrained with its LlavaProcessor: a byte-level BPE
             trained here with `tokenizers` (Llama-3 special tokens and <image>), a chat template that renders a
             message's parts (an image part as <image>) and CLIP's image processor (resize, crop, normalise).
OUT/shapes/  train.jsonl (400 records) and heldout.jsonl (100), each {"messages": [a user turn of an image part and
             "What colour is the shape?", the assistant's colour]}, the images in img/ as PNG: a circle, square or
             triangle of one of 4 colours, at a random place and size on a grey background.

Re-running with the same OUT rewrites the same files (fixed seed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Any

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs", "examples",
                           "tiny-vision")
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
KINDS = ("circle", "square", "triangle")
QUESTION = "What colour is the shape?"
IMAGE_SIZE, PATCH = 32, 8
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<image>"]
# Llama 3's template, minus tools and dates, over messages whose content is a string or a list of parts.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<image>' }}{%- elif part['type'] == 'text' %}{{- part['text'] | trim }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def shape_image(colour: str, kind: str, rng: random.Random) -> Any:
    from PIL import Image, ImageDraw

    grey = rng.randint(90, 160)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (grey, grey, grey))
    size = rng.randint(10, 20)
    x, y = rng.randint(0, IMAGE_SIZE - size), rng.randint(0, IMAGE_SIZE - size)
    draw, fill = ImageDraw.Draw(image), COLOURS[colour]
    if kind == "circle":
        draw.ellipse((x, y, x + size, y + size), fill=fill)
    elif kind == "square":
        draw.rectangle((x, y, x + size, y + size), fill=fill)
    else:
        draw.polygon([(x + size / 2, y), (x, y + size), (x + size, y + size)], fill=fill)
    return image


def record(image_path: str, colour: str) -> dict[str, Any]:
    return {"messages": [
        {"role": "user", "content": [{"type": "image", "path": image_path}, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": [{"type": "text", "text": colour}]}]}


def write_shapes(out: str, seed: int, n_train: int = 400, n_heldout: int = 100) -> dict[str, list[dict[str, Any]]]:
    rng = random.Random(seed)
    os.makedirs(os.path.join(out, "img"), exist_ok=True)
    splits: dict[str, list[dict[str, Any]]] = {"train": [], "heldout": []}
    for i in range(n_train + n_heldout):
        colour, kind = rng.choice(sorted(COLOURS)), rng.choice(KINDS)
        name = f"img/{i:04d}.png"
        shape_image(colour, kind, rng).save(os.path.join(out, name))
        splits["train" if i < n_train else "heldout"].append(record(name, colour))
    for split, records in splits.items():
        with open(os.path.join(out, f"{split}.jsonl"), "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in records)
    return splits


def train_tokenizer(texts: list[str], vocab: int = 320) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                   pad_token="<|end_of_text|>", extra_special_tokens={"image_token": "<image>"},
                                   chat_template=CHAT_TEMPLATE)


def processor(tokenizer: Any) -> Any:
    from transformers import CLIPImageProcessor, LlavaProcessor

    images = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE,
                                                                                "width": IMAGE_SIZE})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
                          vision_feature_select_strategy="default", image_token="<image>",
                          num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)


def save(out: str, seed: int = 0) -> dict[str, Any]:
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    splits = write_shapes(os.path.join(out, "shapes"), seed)
    texts = [QUESTION, *COLOURS, "user", "assistant", "system"] * 20
    tokenizer = train_tokenizer(texts)
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(LlavaConfig(
        text_config=text, vision_config=vision, image_token_index=image_token,
        image_seq_length=(IMAGE_SIZE // PATCH) ** 2, vision_feature_select_strategy="default"))
    model_dir = os.path.join(out, "model")
    model.save_pretrained(model_dir)
    processor(tokenizer).save_pretrained(model_dir)
    return {"model": model_dir, "shapes": os.path.join(out, "shapes"), "train": len(splits["train"]),
            "heldout": len(splits["heldout"]), "image_token_id": image_token}


def answers(model_dir: str, shapes: str, split: str = "heldout") -> list[tuple[str, str]]:
    """(expected, given) for every record of the split: transformers' LlavaForConditionalGeneration and the
    checkpoint's processor, greedy, on the user turn."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for line in open(os.path.join(shapes, f"{split}.jsonl")):
        user, assistant = json.loads(line)["messages"]
        prompt = [{"role": "user", "content": [{"type": "image"}, user["content"][1]]}]
        text = processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        image = Image.open(os.path.join(shapes, user["content"][0]["path"])).convert("RGB")
        inputs = processor(text=text, images=[image], return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=4, do_sample=False,
                                 eos_token_id=processor.tokenizer.eos_token_id)
        given = processor.tokenizer.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        out.append((assistant["content"][0]["text"], given.strip()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--score", metavar="MODEL_DIR", help="print the accuracy of an exported model on the "
                        "held-out images instead (the shapes next to OUT's default, or --shapes)")
    parser.add_argument("--shapes", default=os.path.join(DEFAULT_OUT, "shapes"))
    args = parser.parse_args()
    if args.score:
        pairs = answers(args.score, args.shapes)
        right = sum(expected == given for expected, given in pairs)
        print(json.dumps({"accuracy": right / len(pairs), "right": right, "images": len(pairs),
                          "first": pairs[:4]}))
        return
    print(json.dumps(save(args.out, args.seed)))


if __name__ == "__main__":
    main()
