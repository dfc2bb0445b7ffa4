"""FlexAttention for the attention SDPA cannot fuse (model.attention_kernel: flex, CUDA): sliding windows, packed
documents and soft-capped scores (Gemma 2), in any combination, with a custom scale and grouped kv heads.

SDPA's masked kernels take a dense [s, s] mask and compute every tile of it, and soft-capped scores run the math
path, which materialises heads x s x s scores per layer. FlexAttention takes the mask as a function (a block mask:
the 128 x 128 tiles wholly outside the window, the document or the causal triangle are skipped) and the cap as a
score modifier, inside one compiled kernel: no score matrix, and on CUDA no dense mask (the block mask is built by a
compiled kernel too).

The mask is MaskRows' (model/attention.py): key at or before the query, within the window, in the query's document.
Torch 2.13 has FlexAttention's backward on CUDA only, so a job asks for it on GPUs (config check); on CPU its eager
forward is what the parity tests compare against the SDPA and math paths (tests/model/test_model_flex.py).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch


@functools.lru_cache(maxsize=1)
def _compiled() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _on_cuda(device: Any) -> bool:
    return torch.device(device).type == "cuda"


def block_mask(rows: Any, q_len: int, k_len: int, batch: int, device: Any) -> Any:
    """The block mask of `rows` (a MaskRows; None: plain causal over 0..s-1): built by a compiled kernel on CUDA,
    tile by tile, so no dense [s, s] mask exists (eager elsewhere, where it is built dense: the CPU tests' sizes).
    Each layer builds its own (its window); a cache per forward is a later saving."""
    from torch.nn.attention.flex_attention import create_block_mask

    if rows is None:
        def mask_mod(b, h, qi, ki):
            return ki <= qi
        return create_block_mask(mask_mod, B=None, H=None, Q_LEN=q_len, KV_LEN=k_len, device=device,
                                 _compile=_on_cuda(device))
    q_pos, k_pos, q_seg, k_seg, window = rows.q_pos, rows.k_pos, rows.q_seg, rows.k_seg, rows.window

    def masked(b, h, qi, ki):
        ok = k_pos[ki] <= q_pos[qi]
        if window is not None:
            ok = ok & (q_pos[qi] - k_pos[ki] < window)
        if q_seg is not None:
            ok = ok & (q_seg[b, qi] == k_seg[b, ki])
        return ok

    return create_block_mask(masked, B=batch if q_seg is not None else None, H=None, Q_LEN=q_len, KV_LEN=k_len,
                             device=device, _compile=_on_cuda(device))


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Any, scale: Optional[float],
                   cap: Optional[float]) -> torch.Tensor:
    """q [b, heads, s, d], k/v [b, kv_heads, s, d] -> [b, heads, s, d]: causal attention under the mask `rows`
    describes, scores times `scale` (None: d^-0.5) and soft-capped by `cap` before the mask and softmax (transformers'
    order). Compiled on CUDA; eager elsewhere (forward only on CPU in torch 2.13)."""
    from torch.nn.attention.flex_attention import flex_attention as eager

    mask = block_mask(rows, q.shape[2], k.shape[2], q.shape[0], q.device)
    score_mod = None
    if cap:
        def score_mod(score, b, h, qi, ki):
            return cap * torch.tanh(score / cap)
    fn = _compiled() if q.is_cuda else eager
    return fn(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
