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


def document_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool, True where query i may attend to key j: j <= i and both in the same segment."""
    s = segment_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    return (segment_ids[:, None, :, None] == segment_ids[:, None, None, :]) & causal


def attention_mask(seq_len: int, segment_ids: Optional[torch.Tensor], window: Optional[int],
                   device=None) -> Optional[torch.Tensor]:
    """The boolean mask of one layer ([b or 1, 1, s, s], True: may attend), or None for plain causal attention
    (SDPA's is_causal): documents (segment_ids), and a sliding window (key j within window - 1 positions before
    query i, transformers' `kv_idx > q_idx - sliding_window`) when it is shorter than the sequence."""
    window = window if window is not None and window < seq_len else None
    if segment_ids is None and window is None:
        return None
    if segment_ids is not None:
        mask = document_mask(segment_ids)
        device = segment_ids.device
    else:
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()[None, None]
    if window is not None:
        i = torch.arange(seq_len, device=device)
        mask = mask & ((i[:, None] - i[None, :]) < window)
    return mask


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
    ([b, 1, s, s] bool, attention_mask): documents and windows, instead of the plain causal mask. scale: the
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
        out, lse = _block(q, kk, vv, layout.mask([cp.rank], [src], window), scale, cap)
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
    every = list(range(cp.world_size))
    out = causal_attention(q, k, v, layout.mask(every, every, window), scale, cap)
    return AllToAll.apply(out, 2, 1, cp)


def context_attention(q, k, v, layout: SequenceLayout, window: Optional[int], scale: Optional[float],
                      cap: Optional[float]) -> torch.Tensor:
    attend = ulysses_attention if layout.cp.scheme == "ulysses" else ring_attention
    return attend(q, k, v, layout, window, scale, cap)
