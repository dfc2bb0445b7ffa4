"""Measured gradient-synchronisation time: how much of an optimizer step goes into DeepSpeed's collectives.

    timer = CommTimer()
    with timer.step(measure=(step + 1) % log_every == 0):   # around one optimizer step (fwd+bwd+step)
        loss = train_step(...)
    timer.metrics()   # {"comm/grad_sync_fraction": f, "comm/grad_sync_s": ..., "comm/step_s": ...} or {}

How: on a measured step the collectives of DeepSpeed's communication backend (`deepspeed.comm`'s
backend object, through which ZeRO's reduce/reduce-scatter/all-gather, the engine's gradient all-reduce,
the grad-norm and overflow reductions and pipeline tied-weight all-reduces all go) are wrapped by a
timer; on GPU the device is synchronised before and after each one, so the wall time is the collective's
own. Other steps pay nothing: the wrappers are installed only for the measured step and removed after. The
measured step is therefore slower than the others: the reporter samples it (one log step per window) and leaves
it out of step time, tokens/s and MFU (rayspeed.train.metrics_callback.StepWindow).

What the number means: synchronising around each collective serialises what DeepSpeed would overlap
(overlap_comm), so grad_sync_fraction = (time in gradient collectives) / (step time) of an unoverlapped
step: the share communication would cost if nothing hid it (an upper bound on the exposed share).
Collectives over a group of one rank (dp=1) move nothing and are not counted, so dp=1 gives 0.
Pipeline activations (send/recv) and tensor-parallel collectives (issued by torch.distributed directly in
rayspeed.parallel) are not gradient synchronisation and are not counted.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from typing import Any, Iterator, Optional

from rayspeed import compat

log = logging.getLogger(__name__)

# The backend methods that synchronise gradients or parameters (not point-to-point, not objects).
TIMED_OPS = (
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_base",
    "all_gather_coalesced",
    "broadcast",
    "all_to_all_single",
)


def _sync() -> None:
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    except Exception:
        pass


def _group_size(group: Any) -> int:
    try:
        import torch.distributed as dist

        return dist.get_world_size(group) if group is not None else dist.get_world_size()
    except Exception:
        return 2  # unknown: count it


def _tensor_bytes(x: Any) -> int:
    try:
        import torch

        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, (list, tuple)):
            return sum(_tensor_bytes(t) for t in x)
    except Exception:
        pass
    return 0


# Positional layout of the backend methods (torch.distributed's), for when the real signature is hidden
# behind DeepSpeed's decorators (which take *args, **kwargs and do not functools.wraps).
_POSITIONAL = {
    "all_reduce": ("tensor", "op", "group", "async_op"),
    "all_reduce_coalesced": ("tensors", "op", "group", "async_op"),
    "reduce": ("tensor", "dst", "op", "group", "async_op"),
    "reduce_scatter": ("output", "input_list", "op", "group", "async_op"),
    "reduce_scatter_tensor": ("output_tensor", "input_tensor", "op", "group", "async_op"),
    "all_gather": ("tensor_list", "tensor", "group", "async_op"),
    "all_gather_into_tensor": ("output_tensor", "input_tensor", "group", "async_op"),
    "all_gather_base": ("output_tensor", "input_tensor", "group", "async_op"),
    "all_gather_coalesced": ("output_tensors", "input_tensors", "group", "async_op"),
    "broadcast": ("tensor", "src", "group", "async_op"),
    "all_to_all_single": ("output", "input", "output_split_sizes", "input_split_sizes", "group", "async_op"),
}


def _call_signature(name: str, fn: Any) -> Optional[inspect.Signature]:
    """The signature the backend method is called with (without self): found through the decorators'
    closures, else the torch.distributed layout above."""
    seen: set[int] = set()
    todo = [getattr(fn, "__func__", fn)]
    while todo:
        f = todo.pop(0)
        if id(f) in seen or not callable(f):
            continue
        seen.add(id(f))
        try:
            sig = inspect.signature(f)
            if "group" in sig.parameters:
                params = list(sig.parameters.values())
                if params and params[0].name == "self":
                    params = params[1:]
                return sig.replace(parameters=params)
        except (TypeError, ValueError):
            pass
        inner = getattr(f, "__wrapped__", None)
        if inner is not None:
            todo.append(inner)
        for cell in getattr(f, "__closure__", None) or ():
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            if inspect.isfunction(v):
                todo.append(v)
    names = _POSITIONAL.get(name)
    if names is None:
        return None
    P = inspect.Parameter
    return inspect.Signature([P(n, P.POSITIONAL_OR_KEYWORD, default=None if i else P.empty)
                              for i, n in enumerate(names)] + [P("kwargs", P.VAR_KEYWORD)])


class CommTimer:
    """Times DeepSpeed's gradient collectives on the steps it is asked to measure (see module doc)."""

    def __init__(self, enabled: bool = True):
        self.enabled = bool(enabled)
        self._last: Optional[dict[str, float]] = None
        self._comm_s = 0.0
        self._calls = 0
        self._bytes = 0
        self._depth = 0
        self._warned = False
        self._ops: dict[str, list[float]] = {}
        self.breakdown: dict[str, dict[str, float]] = {}
        """Per collective of the last measured step: {"all_reduce[2]": {"calls": n, "seconds": s}} (group size in [])"""

    # ------------------------------------------------------------------ wrapping
    def _wrap(self, name: str, fn: Any) -> Any:
        sig = _call_signature(name, fn)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:  # a backend op calling another: count the outer one only
                return fn(*args, **kwargs)
            group, async_op, first = None, False, args[0] if args else None
            if sig is not None:
                try:
                    bound = sig.bind_partial(*args, **kwargs)
                    group = bound.arguments.get("group")
                    async_op = bool(bound.arguments.get("async_op", False))
                    vals = list(bound.arguments.values())[:2]
                    first = max(vals, key=_tensor_bytes) if vals else first
                except TypeError:
                    pass
            size = _group_size(group)
            if size <= 1:
                return fn(*args, **kwargs)
            _sync()
            t0 = time.perf_counter()
            self._depth += 1
            try:
                work = fn(*args, **kwargs)
                if async_op and work is not None and hasattr(work, "wait"):
                    work.wait()  # measured steps only: complete it here so its time is counted
                _sync()
            finally:
                self._depth -= 1
                dt = time.perf_counter() - t0
                self._comm_s += dt
                self._calls += 1
                op = self._ops.setdefault(f"{name}[{size}]", [0.0, 0.0])
                op[0] += 1
                op[1] += dt
                self._bytes += _tensor_bytes(first)
            return work

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    @contextlib.contextmanager
    def _installed(self) -> Iterator[bool]:
        cdb = compat.deepspeed_comm_backend()
        if cdb is None:
            yield False
            return
        ops = {name: getattr(cdb, name, None) for name in TIMED_OPS}
        wrapped = {name: self._wrap(name, fn) for name, fn in ops.items() if fn is not None and callable(fn)}
        with compat.methods_replaced(cdb, wrapped):
            yield True

    # ------------------------------------------------------------------ API
    @contextlib.contextmanager
    def step(self, measure: bool = True) -> Iterator[None]:
        """Around one optimizer step. Exceptions from the step propagate; the timer's own never do."""
        if not (self.enabled and measure):
            yield
            return
        try:
            cm = self._installed()
            ok = cm.__enter__()
        except Exception as e:  # instrumentation must not stop training
            self._warn(e)
            yield
            return
        self._comm_s, self._calls, self._bytes, self._depth = 0.0, 0, 0, 0
        self._ops = {}
        _sync()
        t0 = time.perf_counter()
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            _sync()
            step_s = time.perf_counter() - t0
            try:
                cm.__exit__(None, None, None)
            except Exception as e:
                self._warn(e)
            if ok and not failed and step_s > 0:
                comm = min(self._comm_s, step_s)
                self._last = {
                    "comm_s": comm,
                    "step_s": step_s,
                    "grad_sync_fraction": comm / step_s,
                    "calls": float(self._calls),
                    "bytes": float(self._bytes),
                }
                self.breakdown = {k: {"calls": v[0], "seconds": v[1]} for k, v in self._ops.items()}

    def last(self) -> Optional[dict[str, float]]:
        """dict(comm_s, step_s, grad_sync_fraction, calls, bytes) of the last measured step; None if no step
        was measured yet (or deepspeed.comm is not initialised, so there is nothing to measure)."""
        return dict(self._last) if self._last is not None else None

    def metrics(self) -> dict[str, float]:
        """MLflow metrics of the last measured step ({} if none): comm/grad_sync_fraction and its parts."""
        last = self._last
        if last is None:
            return {}
        return {
            "comm/grad_sync_fraction": last["grad_sync_fraction"],
            "comm/grad_sync_s": last["comm_s"],
            "comm/step_s": last["step_s"],
        }

    def _warn(self, e: Exception) -> None:
        if not self._warned:
            log.warning("gradient-sync timer disabled for this step (%s)", e)
            self._warned = True
