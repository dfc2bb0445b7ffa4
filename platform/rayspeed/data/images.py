"""Images in chat records: where each comes from, read once in the tokenization pass, resized there by the
checkpoint's own image processor and kept as uint8 beside the tokens; normalised in the worker.

A message's content is a string or a list of parts, as transformers' processors take them:
    {"type": "text", "text": "What colour is the shape?"}
    {"type": "image", "path": "img/0001.png"}        # relative to the data file
    {"type": "image", "url": "https://..."}          # fetched once, with a timeout
    {"type": "image", "image": "data:image/png;base64,..."}
or TRL's form: parts {"type": "image"} without a source, and the record's `images` column giving them in order (paths,
data URIs, or a datasets Image's {"bytes", "path"}). A missing or unreadable image is a ConfigError naming the record
(file:line) and the image; a video part too (not built).

    parts = ImageParts(record, "chats.jsonl:12", base_dir)      # .messages (for the template), .sources
    prep = ImagePrep.from_model(model_dir)                       # the checkpoint's image processor
    pixels = prep.to_uint8(prep.open(source, where))             # [3, H, W] uint8: resized and cropped, no more
    prep.normalize(pixels)                                       # float32, as the processor's pixel_values
    expand_placeholders(ids, mask, image_token_id, tokens)       # one placeholder -> one token per image feature
"""

from __future__ import annotations

import base64
import io
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from rayspeed.errors import ConfigError

URL_TIMEOUT_S = 20.0
PART_TYPES = ("text", "image")


def has_parts(messages: Any) -> bool:
    """Some message's content is a list of parts (not a plain string)."""
    return isinstance(messages, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                              for m in messages)


@dataclass
class ImageParts:
    """A record's messages with each image part reduced to {"type": "image"} (what chat templates read), and the
    images' sources in order."""
    record: dict[str, Any]
    where: str
    base_dir: str
    messages: list[dict[str, Any]] = field(init=False)
    sources: list[Any] = field(init=False)

    def __post_init__(self) -> None:
        column = self.record.get("images")
        if column is not None and not isinstance(column, list):
            raise ConfigError(f"data.format: chat: {self.where}: 'images' must be a list of images")
        given = list(column or [])
        self.messages, self.sources = [], []
        for i, message in enumerate(self.record.get("messages") or []):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                self.messages.append(message)
                continue
            parts = [self._part(i, j, part, given) for j, part in enumerate(content)]
            self.messages.append({**message, "content": parts})
        if given:
            raise ConfigError(f"data.format: chat: {self.where}: {len(given)} image(s) in 'images' beyond the "
                              f"{len(self.sources)} image part(s) of the messages; give one {{\"type\": \"image\"}} "
                              "part per image")

    def _part(self, i: int, j: int, part: Any, given: list[Any]) -> dict[str, Any]:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "video":
            raise ConfigError(f"data.format: chat: {self.where}: message {i} part {j} is a video: not supported yet "
                              "(images only)")
        if kind not in PART_TYPES:
            raise ConfigError(f"data.format: chat: {self.where}: message {i} part {j} must be an object with type "
                              f"{' or '.join(PART_TYPES)}, got {part!r:.80}")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ConfigError(f"data.format: chat: {self.where}: message {i} part {j}: a text part needs a string "
                                  "'text'")
            return {"type": "text", "text": part["text"]}
        source = next((part[k] for k in ("path", "url", "image") if part.get(k) is not None), None)
        if source is None:
            if not given:
                raise ConfigError(f"data.format: chat: {self.where}: message {i} part {j}: an image part needs "
                                  "'path', 'url' or 'image' (a data URI), or the record's 'images' column")
            source = given.pop(0)
        elif "path" in part and isinstance(source, str):
            source = {"path": source}
        self.sources.append(source)
        return {"type": "image"}

    def open(self, index: int) -> Any:
        """Image `index` as an RGB PIL image (ConfigError naming the record and the image)."""
        return open_image(self.sources[index], self.where, self.base_dir)


def open_image(source: Any, where: str, base_dir: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    what, data = _bytes(source, where, base_dir)
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise ConfigError(f"data.path: {where}: image {what} is not a readable image ({e})") from None


def _bytes(source: Any, where: str, base_dir: str) -> tuple[str, bytes]:
    """(how the image is named in messages, its encoded bytes)."""
    if isinstance(source, dict) and source.get("bytes") is not None:  # a datasets Image feature's value
        return str(source.get("path") or "bytes"), bytes(source["bytes"])
    path = source.get("path") if isinstance(source, dict) else source
    if not isinstance(path, str):
        raise ConfigError(f"data.path: {where}: an image must be a path, a URL or a data URI, got {path!r:.80}")
    if path.startswith("data:"):
        header, _, payload = path.partition(",")
        try:
            return "data URI", base64.b64decode(payload, validate=True) if header.endswith(";base64") else \
                payload.encode()
        except ValueError as e:
            raise ConfigError(f"data.path: {where}: image data URI is not valid base64 ({e})") from None
    if path.startswith(("http://", "https://")):
        from urllib.request import urlopen

        try:
            with urlopen(path, timeout=URL_TIMEOUT_S) as response:  # noqa: S310 - the records' own URLs
                return path, response.read()
        except OSError as e:
            raise ConfigError(f"data.path: {where}: image {path} could not be fetched ({e})") from None
    full = path if os.path.isabs(path) else os.path.join(base_dir, path)
    try:
        with open(full, "rb") as fh:
            return full, fh.read()
    except OSError as e:
        raise ConfigError(f"data.path: {where}: image {full} cannot be read ({e.strerror or e})") from None


class ImagePrep:
    """The checkpoint's image processor split in two: resizing and cropping here (uint8, once, in the tokenization
    pass), rescaling and normalising in the worker (normalize), so a cached image costs 1 byte a value, not 4."""

    def __init__(self, processor: Any):
        self.processor = processor
        self.rescale = float(getattr(processor, "rescale_factor", 1 / 255))
        self.mean = np.asarray(processor.image_mean, dtype=np.float32).reshape(-1, 1, 1)
        self.std = np.asarray(processor.image_std, dtype=np.float32).reshape(-1, 1, 1)

    @classmethod
    def from_model(cls, model_dir: str) -> "ImagePrep":
        from transformers import AutoImageProcessor

        return cls(AutoImageProcessor.from_pretrained(model_dir))

    def to_uint8(self, image: Any) -> np.ndarray:
        out = self.processor(images=[image], do_rescale=False, do_normalize=False, return_tensors="np")
        pixels = np.asarray(out["pixel_values"][0])
        return np.clip(np.rint(pixels), 0, 255).astype(np.uint8)

    def normalize(self, pixels: Any) -> np.ndarray:
        return ((np.asarray(pixels, dtype=np.float32) * np.float32(self.rescale)) - self.mean) / self.std


def expand_placeholders(ids: np.ndarray, mask: Optional[np.ndarray], image_token_id: int, tokens: int
                        ) -> tuple[np.ndarray, Optional[np.ndarray], np.ndarray]:
    """Each placeholder token repeated to one per image feature (never trained on): (ids, mask, where each image's
    tokens start)."""
    at = np.flatnonzero(ids == image_token_id)
    repeats = np.ones(ids.size, dtype=np.int64)
    repeats[at] = tokens
    out = np.repeat(ids, repeats)
    starts = at + np.arange(at.size) * (tokens - 1)
    if mask is None:
        return out, None, starts
    expanded = np.repeat(mask, repeats)
    for s in starts:
        expanded[s:s + tokens] = 0
    return out, expanded, starts
