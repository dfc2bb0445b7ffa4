"""torch internals rayspeed uses (written for torch 2.13); each says why and when it can go."""

from __future__ import annotations

from typing import Any


def fused_optimizer_devices() -> tuple[str, ...]:
    """The device types torch's fused AdamW runs on. Why: torch has no public query (2.13); the fused CPU kernel
    saves ~6% of a CPU step (engine/optim.py). Remove when torch exposes one. If the helper moves: () (torch's
    default implementation is used)."""
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        return tuple(_get_fused_kernels_supported_devices())
    except Exception:
        return ()


def storage_identity(storage: Any) -> int:
    """What torch.save keys a storage by (torch.serialization's persistent_id: `storage._cdata`, the address of the
    C++ storage object): the asynchronous checkpoint's host copy makes one copy per storage under this key, so
    tensors sharing a storage still share it and torch.save of the copy writes what a synchronous save writes.
    Why: torch has no public storage identity (2.13); `data_ptr()` is not one (storages with no bytes share 0).
    Remove when torch exposes one; if `_cdata` moves, torch.save moved with it: re-check checkpoint/host_copy.py."""
    return storage._cdata


def compile_errors_fall_back_to_eager() -> None:
    """A torch.compile failure runs that frame eagerly, with a warning, instead of failing the job
    (train.compile: auto). Why: `torch._dynamo.config.suppress_errors` is the only switch (torch 2.13). Remove
    when torch.compile takes a per-call fallback option."""
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
