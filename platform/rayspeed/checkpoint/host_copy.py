"""The snapshot of an asynchronous save: a copy in host memory of what DeepSpeed hands to torch.save.

`HostCopy.copy(state)` returns the same structure (dicts with their type and attributes such as a state dict's
`_metadata`, lists, tuples, nn.Parameters, requires_grad) whose tensors live in host buffers: each storage is
copied once, whole, and every tensor is rebuilt as the same view (offset, size, stride) of its copy, so storage
sharing is kept exactly as torch.save sees it (it writes each storage once, keyed by identity). torch.save of the
copy therefore writes the bytes a synchronous save writes (on GPU the storages' location tag says cpu; DeepSpeed
loads every storage onto the CPU first either way). Containers shared inside the state stay shared.

The buffers are kept and reused by the next snapshot when the sizes match (pinned on GPU, so the device -> host
copy runs at full bandwidth and without page faults), like PyTorch's cached async checkpoint staging: the host
memory of one checkpoint is taken once (rayspeed.planner.checkpoint_memory plans it). The caller must not take a
new snapshot while the previous one is still being written (CheckpointManager keeps one save in flight).
"""

from __future__ import annotations

import copy as pycopy
from typing import Any

import torch

from rayspeed.compat import storage_identity

_ATOMS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.Size)


class HostCopy:
    def __init__(self) -> None:
        self._pool: list[Any] = []  # host UntypedStorages, in the order the last snapshot used them
        self._next = 0
        self._storages: dict[Any, Any] = {}
        self._memo: dict[int, Any] = {}
        self._keep: list[Any] = []  # originals kept alive while their id() is a memo key
        self.nbytes = 0
        self.cuda = False

    def begin(self) -> None:
        """Start a snapshot (one per checkpoint: storages shared across its files are copied once)."""
        self._next, self._storages, self._memo, self._keep = 0, {}, {}, []
        self.nbytes, self.cuda = 0, False

    def end(self) -> None:
        """The snapshot is complete: device copies have landed; the originals may change from here on."""
        if self.cuda:
            torch.cuda.synchronize()
        self._storages, self._memo, self._keep = {}, {}, []

    def copy(self, obj: Any) -> Any:
        if isinstance(obj, _ATOMS):
            return obj
        key = id(obj)
        if key in self._memo:
            return self._memo[key]
        self._keep.append(obj)
        if isinstance(obj, torch.Tensor):
            out: Any = self._tensor(obj)
        elif isinstance(obj, dict):
            out = pycopy.copy(obj)  # same type, attributes and (defaultdict) factory; refilled below
            out.clear()
            self._memo[key] = out  # before the values: a container that holds itself stays one object
            for k, v in obj.items():
                out[k] = self.copy(v)
            if getattr(obj, "__dict__", None):
                out.__dict__.update(self.copy(dict(obj.__dict__)))
            return out
        elif isinstance(obj, list):
            out = type(obj)()
            self._memo[key] = out
            out.extend(self.copy(v) for v in obj)
            return out
        elif isinstance(obj, tuple):
            items = [self.copy(v) for v in obj]
            out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        elif isinstance(obj, (set, frozenset)):
            out = type(obj)(self.copy(v) for v in obj)
        else:  # enums, namespaces, small objects: a deep copy (their tensors, if any, are not expected)
            try:
                out = pycopy.deepcopy(obj)
            except Exception:
                out = obj
        self._memo[key] = out
        return out

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        src = t.untyped_storage()
        sid = storage_identity(src)  # one copy per storage, shared like the original
        host = self._storages.get(sid)
        if host is None:
            host = self._buffer(src.nbytes(), src.device.type == "cuda")
            host.copy_(src, non_blocking=src.device.type == "cuda")
            self.cuda = self.cuda or src.device.type == "cuda"
            self._storages[sid] = host
        view = torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
        if isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(view, requires_grad=t.requires_grad)
        if t.requires_grad:
            view.requires_grad_(True)
        return view

    def _buffer(self, nbytes: int, pin: bool) -> Any:
        i = self._next
        self._next += 1
        self.nbytes += nbytes
        if i < len(self._pool) and self._pool[i].nbytes() == nbytes:
            return self._pool[i]
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available()).untyped_storage()
        if i < len(self._pool):
            self._pool[i] = buf
        else:
            self._pool.append(buf)
        return buf

    def release(self) -> None:
        """Drop the cached buffers (host memory back to the allocator)."""
        self._pool = []
