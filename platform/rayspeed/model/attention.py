"""Attention as rayspeed's model computes it: the masks (causal, documents, sliding windows), SDPA with a custom
scale, the math path for soft-capped scores, and attention across the parts of a context-parallel sequence (the
ulysses and ring schemes of parallel/context_parallel.py)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from rayspeed.parallel.context_parallel import AllToAll, RingShift, SequenceLayout
from rayspeed.parallel.loss import softcap

MASKED = -1e30  # finite: a ring block with no visible key for a query weighs exp(MASKED - lse) = 0, gradient finite
# A layer's boolean mask bigger than this (batch x queries x keys bytes) is never built whole: it is made a tile of
# query rows at a time, and again in backward (a 128k-token document mask would be 16 GiB). Mirrored by
# planner/memory.py MASK_TILE_BYTES.
MASK_TILE_BYTES = 1 << 26


class MaskRows:
    """A boolean attention mask described by positions, built a tile of query rows at a time: query and key
    positions ([s_q], [s_k]; global ones under context parallelism), their document ids ([b, s_q], [b, s_k] or
    None), a sliding window. True where the key is at or before the query, within the window, in its document.
    `ordered`: both position lists are 0..s-1, so a tile's keys past its last query (and before its window) can be
    skipped, not just masked."""

    def __init__(self, q_pos: torch.Tensor, k_pos: torch.Tensor, q_seg: Optional[torch.Tensor] = None,
                 k_seg: Optional[torch.Tensor] = None, window: Optional[int] = None, ordered: bool = False):
        self.q_pos, self.k_pos, self.q_seg, self.k_seg, self.window = q_pos, k_pos, q_seg, k_seg, window
        self.ordered = ordered
        self.batch = 1 if q_seg is None else q_seg.shape[0]

    @classmethod
    def of(cls, seq_len: int, segment_ids: Optional[torch.Tensor], window: Optional[int],
           device=None) -> Optional["MaskRows"]:
        """The unsplit sequence's mask, or None for plain causal attention (SDPA's is_causal): documents, and a
        sliding window (key j within window - 1 positions before query i, transformers' `kv_idx > q_idx -
        sliding_window`) when it is shorter than the sequence."""
        window = window if window is not None and window < seq_len else None
        if segment_ids is None and window is None:
            return None
        pos = torch.arange(seq_len, device=segment_ids.device if segment_ids is not None else device)
        return cls(pos, pos, segment_ids, segment_ids, window, ordered=True)

    def keys(self, i0: int, i1: int) -> tuple[int, int]:
        """The key range queries i0..i1 may see at all (every key when the positions are not in order)."""
        if not self.ordered:
            return 0, self.k_pos.shape[0]
        return (max(0, i0 - self.window + 1) if self.window else 0), i1

    def rows(self, i0: int, i1: int, k0: int = 0, k1: Optional[int] = None) -> torch.Tensor:
        """[b or 1, 1, i1 - i0, k1 - k0] bool."""
        qi, ki = self.q_pos[i0:i1], self.k_pos[k0:k1]
        allowed = ki[None, :] <= qi[:, None]
        if self.window is not None:
            allowed = allowed & ((qi[:, None] - ki[None, :]) < self.window)
        allowed = allowed[None, None]
        if self.q_seg is not None:
            assert self.k_seg is not None  # document ids come for both sides or neither
            allowed = allowed & (self.q_seg[:, None, i0:i1, None] == self.k_seg[:, None, None, k0:k1])
        return allowed


def _tile(q, k, v, rows: MaskRows, i0: int, i1: int, k0: int, k1: int, scale, cap):
    return causal_attention(q, k[:, :, k0:k1], v[:, :, k0:k1], rows.rows(i0, i1, k0, k1), scale, cap)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Optional[MaskRows],
                     scale: Optional[float] = None, cap: Optional[float] = None) -> torch.Tensor:
    """causal_attention with the mask `rows` describes: built whole while it is at most MASK_TILE_BYTES, else one
    tile of query rows at a time under a non-reentrant checkpoint (each tile's mask and scores are rebuilt in
    backward; the tiles share q, k and v), so the mask never grows with s squared."""
    if rows is None:
        return causal_attention(q, k, v, None, scale, cap)
    sq, sk = q.shape[2], k.shape[2]
    if rows.batch * sq * sk <= MASK_TILE_BYTES:
        return causal_attention(q, k, v, rows.rows(0, sq), scale, cap)
    from torch.utils.checkpoint import checkpoint

    tile = max(1, MASK_TILE_BYTES // (rows.batch * sk))
    outs = []
    for i0 in range(0, sq, tile):
        i1 = min(sq, i0 + tile)
        k0, k1 = rows.keys(i0, i1)
        outs.append(checkpoint(_tile, q[:, :, i0:i1], k, v, rows, i0, i1, k0, k1, scale, cap, use_reentrant=False))
    return torch.cat(outs, dim=2)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                         scale: Optional[float], cap: float) -> torch.Tensor:
    """Attention whose scores are soft-capped before the mask and softmax (Gemma 2): no SDPA kernel takes a score
    modifier, so the scores are materialised (s x s per head; the softmax in fp32, as transformers' eager path)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = q.shape[-2]
    if mask is None:
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()[None, None]
    scores = softcap((q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5), cap)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    return probs @ v


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                     cap: Optional[float] = None) -> torch.Tensor:
    """SDPA with is_causal; q [b, heads, s, d], k/v [b, kv_heads, s, d] with heads a multiple of kv_heads. mask
    ([b or 1, 1, s, s] bool, MaskRows.rows): documents and windows, instead of the plain causal mask. scale: the
    softmax scale (None: d^-0.5). cap: soft-capped scores (softcapped_attention)."""
    if cap:
        return softcapped_attention(q, k, v, mask, scale, cap)
    causal: dict = dict(is_causal=True) if mask is None else dict(attn_mask=mask)
    if scale is not None:
        causal["scale"] = scale
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, **causal)
    if mask is None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        # The flash kernel indexes the shared kv heads itself: no expanded copy of k and v. (With a document mask
        # flash does not apply; the memory-efficient kernel takes the mask but not enable_gqa: k/v are expanded.)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **causal)
    # Elsewhere (fp32, CPU) no fused kernel broadcasts kv heads and enable_gqa would silently
    # fall back to the unfused math kernel; expanding k/v keeps a fused one.
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, **causal)


def _block(q, k, v, mask, scale, cap):
    """One block's attention output and per-query log-sum-exp (fp32), k/v already expanded to q's heads."""
    scores = softcap((q @ k.transpose(-1, -2)).float() * scale, cap)
    scores = scores.masked_fill(~mask, MASKED)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return (torch.exp(scores - lse).to(v.dtype) @ v), lse


def _expand(k, v, heads):
    groups = heads // k.shape[1]
    return (k, v) if groups == 1 else (k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1))


def ring_attention(q, k, v, layout: SequenceLayout, window: Optional[int], scale: Optional[float],
                   cap: Optional[float]) -> torch.Tensor:
    """q [b, heads, s_local, d], k/v [b, kv_heads, s_local, d]: the keys and values go around the ring; the blocks
    merge through their log-sum-exps."""
    cp = layout.cp
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    outs, lses = [], []
    for step in range(cp.world_size):
        src = (cp.rank - step) % cp.world_size
        kk, vv = _expand(k, v, q.shape[1])
        out, lse = _block(q, kk, vv, layout_rows(layout, [cp.rank], [src], window).rows(0, q.shape[2]), scale, cap)
        outs.append(out)
        lses.append(lse)
        if step + 1 < cp.world_size:
            k, v = RingShift.apply(k, cp), RingShift.apply(v, cp)
    total = torch.logsumexp(torch.stack(lses), dim=0)
    return sum(torch.exp(lse - total).to(o.dtype) * o for o, lse in zip(outs, lses))


def ulysses_attention(q, k, v, layout: SequenceLayout, window: Optional[int], scale: Optional[float],
                      cap: Optional[float]) -> torch.Tensor:
    """The same through two all-to-alls: the whole sequence for heads / cp of the heads on each rank. Fewer kv
    heads than cp (GQA) are repeated up to cp, in order, so each rank still gets the kv head its query heads use."""
    cp = layout.cp
    if q.shape[1] % cp.world_size or (k.shape[1] % cp.world_size and cp.world_size % k.shape[1]):
        raise ValueError(f"ulysses needs the heads ({q.shape[1]}) of a rank to divide by cp={cp.world_size} and its kv "
                         f"heads ({k.shape[1]}) to divide by cp or divide cp: use the ring scheme")
    if k.shape[1] < cp.world_size:
        k, v = (t.repeat_interleave(cp.world_size // k.shape[1], dim=1) for t in (k, v))
    q, k, v = (AllToAll.apply(t, 1, 2, cp) for t in (q, k, v))
    # The all-to-all leaves the rows in the order of the parts; put them in sequence order so that plain causal
    # attention is SDPA's is_causal (its fused kernel, no mask) and a mask is the unsplit sequence's.
    order = torch.cat(layout.index)
    natural = torch.argsort(order)
    q, k, v = (t.index_select(2, natural) for t in (q, k, v))
    rows = MaskRows.of(order.numel(), layout.whole_segments, window, q.device)
    out = masked_attention(q, k, v, rows, scale, cap).index_select(2, order)
    return AllToAll.apply(out, 2, 1, cp)


def layout_rows(layout: SequenceLayout, q_ranks: list[int], k_ranks: list[int], window: Optional[int]) -> MaskRows:
    """The mask between the parts of q_ranks (queries) and those of k_ranks (keys), by global position."""
    qi = torch.cat([layout.index[r] for r in q_ranks])
    ki = torch.cat([layout.index[r] for r in k_ranks])
    qs = ks = None
    if layout.segments is not None:
        qs = torch.cat([layout.segments[r] for r in q_ranks], dim=1)
        ks = torch.cat([layout.segments[r] for r in k_ranks], dim=1)
    return MaskRows(qi, ki, qs, ks, window)


def context_attention(q, k, v, layout: SequenceLayout, window: Optional[int], scale: Optional[float],
                      cap: Optional[float]) -> torch.Tensor:
    attend = ulysses_attention if layout.cp.scheme == "ulysses" else ring_attention
    return attend(q, k, v, layout, window, scale, cap)
