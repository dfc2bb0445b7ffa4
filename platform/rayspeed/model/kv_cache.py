"""What a decoding pass keeps between forwards: each attention layer's keys and values so far, and where each row's
tokens sit.

A batch of prompts of different lengths is left-padded: the pads are the rows' first tokens, a document of their
own (a real token never attends to one), and each row's positions count from its first real token, as
transformers' generate counts them from the attention mask. The state rides through the decoder where the segment
ids do (Transformer.forward's `segment_ids`); an attention layer that knows it (Attention.decode) appends its keys
and values and attends over everything cached; the rest of the model is unchanged.
"""

from __future__ import annotations

import torch

from rayspeed.model.attention import MaskRows


class DecodeState:
    """The rows' real-token mask grows with each forward's tokens (`extend`); `seen` counts the tokens every layer
    has cached already. Layers find their cache by their own identity."""

    def __init__(self, valid: torch.Tensor):
        self.valid = valid.to(torch.bool)  # [b, tokens so far]: False on the left pads
        self.seen = 0
        self._caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._new_tokens()

    def extend(self, valid: torch.Tensor) -> None:
        """The next forward's tokens [b, s] (whether each is real): called after a forward, before the next one."""
        self.seen = self.valid.shape[1]
        self.valid = torch.cat([self.valid, valid.to(torch.bool)], dim=1)
        self._new_tokens()

    def _new_tokens(self) -> None:
        # Once per forward, not once per layer: every layer reads the same positions and mask.
        seg = self.valid.to(torch.long)
        self._positions = (seg.cumsum(dim=1) - 1).clamp(min=0)[:, self.seen:]
        self._index = torch.arange(seg.shape[1], device=seg.device)
        self._seg = seg

    def positions(self) -> torch.Tensor:
        """RoPE positions [b, s] of the new tokens: how many real tokens precede each (0 for the pads)."""
        return self._positions

    def rows(self, window: int | None) -> MaskRows:
        """The new tokens' mask over every key so far: causal by index (the pads come first, so index differences are
        position differences for real tokens, and the window applies to them), the real tokens and the pads two
        documents."""
        index, seg = self._index, self._seg
        return MaskRows(index[self.seen:], index, seg[:, self.seen:], seg, window)

    def append(self, layer: object, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values [b, kv_heads, s, d] added to its cache; every key and value so far."""
        old = self._caches.get(id(layer))
        if old is not None:
            k, v = torch.cat([old[0], k], dim=2), torch.cat([old[1], v], dim=2)
        self._caches[id(layer)] = (k, v)
        return k, v


def segments_of(valid: torch.Tensor) -> torch.Tensor:
    """A left-padded batch's segment ids for a whole forward without a cache: the pads one document, the real tokens
    another, so positions restart at the first real token (the same function as the cached path)."""
    return valid.to(torch.long)
