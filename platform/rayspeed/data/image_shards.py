"""The images of a shard, beside it in the data cache: uint8 pixels as the checkpoint's processor resized them, where
each image's placeholder tokens start in the shard's token stream, and how to normalise them (the processor's
rescale factor, mean and standard deviation), so a worker needs no processor.

    <shard>.images.npy       uint8 [n, channels, height, width]
    <shard>.image_at.npy     int64 [n]: the token position of each image's first placeholder
    <shard>.images.json      {"images": n, "tokens": per image, "rescale", "mean", "std"}

A training window holds whole images and, where it cuts one, part of it: `window_images` gives the images that touch
each window's inputs with the rows of their features that fall inside (the model writes exactly those over the
window's placeholders), so packing never drops or misaligns an image.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Optional, Sequence

import numpy as np

IMAGES_SUFFIX, AT_SUFFIX, META_SUFFIX = ".images.npy", ".image_at.npy", ".images.json"


def write_images(path: str, pixels: list[np.ndarray], at: Sequence[int], meta: dict[str, Any]) -> dict[str, Any]:
    """Write shard `path`'s images; its index entry's {"images", "images_sha256"}."""
    stack = np.stack(pixels).astype(np.uint8) if pixels else np.zeros((0, 3, 1, 1), np.uint8)
    digest = hashlib.sha256()
    for suffix, array in ((IMAGES_SUFFIX, stack), (AT_SUFFIX, np.asarray(at, dtype=np.int64))):
        np.save(path + suffix, array)
        with open(path + suffix, "rb") as fh:
            digest.update(fh.read())
    with open(path + META_SUFFIX, "w") as fh:
        json.dump({**meta, "images": len(pixels)}, fh)
    return {"images": len(pixels), "images_sha256": digest.hexdigest()}


class ImageTable:
    """Every image of a corpus's shards, by global token position."""

    def __init__(self, parts: list[tuple[np.ndarray, np.ndarray]], meta: dict[str, Any]):
        self.parts = parts  # (pixels memmap, global positions) per shard with images
        self.at = np.concatenate([a for _, a in parts]) if parts else np.zeros(0, np.int64)
        self.owner = np.concatenate([np.full(a.size, i) for i, (_, a) in enumerate(parts)]) if parts else self.at
        self.local = np.concatenate([np.arange(a.size) for _, a in parts]) if parts else self.at
        self.tokens = int(meta["tokens"])
        self.rescale = np.float32(meta["rescale"])
        self.mean = np.asarray(meta["mean"], np.float32).reshape(-1, 1, 1)
        self.std = np.asarray(meta["std"], np.float32).reshape(-1, 1, 1)

    @classmethod
    def open(cls, paths: list[str], bases: list[int]) -> Optional["ImageTable"]:
        """The images of shard files `paths` whose tokens start at `bases` (None: the shards hold none)."""
        parts, meta = [], None
        for path, base in zip(paths, bases):
            if not os.path.exists(path + META_SUFFIX):
                continue
            with open(path + META_SUFFIX) as fh:
                meta = json.load(fh)
            parts.append((np.load(path + IMAGES_SUFFIX, mmap_mode="r"), np.load(path + AT_SUFFIX) + base))
        return None if meta is None else cls(parts, meta)

    def normalized(self, i: int) -> np.ndarray:
        pixels = self.parts[int(self.owner[i])][0][int(self.local[i])]
        return (np.asarray(pixels, np.float32) * self.rescale - self.mean) / self.std

    def window_images(self, starts: Sequence[int], seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pixel values float32 [k, c, h, w], rows int64 [k, 2], windows int64 [k]) of the images whose
        placeholders touch the inputs of the windows starting at `starts` (each seq_len inputs long), window by
        window in token order; rows [lo, hi): the image's features inside its window."""
        picked, rows, windows = [], [], []
        for w, a in enumerate(starts):
            first = int(np.searchsorted(self.at, a - self.tokens + 1, side="left"))
            last = int(np.searchsorted(self.at, a + seq_len, side="left"))
            for i in range(first, last):
                p = int(self.at[i])
                picked.append(self.normalized(i))
                rows.append((max(0, a - p), min(self.tokens, a + seq_len - p)))
                windows.append(w)
        if not picked:
            return np.zeros((0, 1, 1, 1), np.float32), np.zeros((0, 2), np.int64), np.zeros(0, np.int64)
        return np.stack(picked), np.asarray(rows, dtype=np.int64), np.asarray(windows, dtype=np.int64)
