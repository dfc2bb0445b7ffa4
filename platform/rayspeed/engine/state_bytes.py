"""What the real engine holds on this rank, by part: checked against the planner's model-state bytes."""

from __future__ import annotations

from typing import Any

import torch


def _bytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def model_state_bytes(engine: Any) -> dict[str, int]:
    """Bytes of this rank's weights, fp32 master copies and optimizer states (after the first step, when
    the optimizer state exists). ZeRO-3 parameters count their local partition (ds_tensor)."""
    weights = 0
    for p in engine.module.parameters():
        weights += _bytes(getattr(p, "ds_tensor", None)) if hasattr(p, "ds_tensor") else _bytes(p)
    for m in engine.module.modules():  # QLoRA's 4-bit base weights are buffers (rayspeed.adapters.nf4)
        weights += m.nbytes() if callable(getattr(m, "nbytes", None)) else 0
    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)  # DeepSpeed's ZeRO wrappers hold the torch optimizer
    states = 0
    seen: set[int] = set()
    for st in base.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and id(v) not in seen:
                seen.add(id(v))
                states += _bytes(v)
    master = 0
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        for t in getattr(opt, name, None) or []:
            master += _bytes(t)
    return {"weights": weights, "master_weights": master, "optimizer_states": states}
