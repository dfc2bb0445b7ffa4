"""Loss-landscape projection around the current weights (Li et al., "Visualizing the Loss Landscape of
Neural Nets", 2018), for spotting a broken parallel layout: a healthy run sits in a smooth basin.

    res = loss_landscape(engine.module, val_batches, None, seed=cfg.train.seed, group=groups.dp_group)

Directions: a Gaussian random tensor per parameter, filter-normalised: every row along dim 0 (a filter,
an output unit) is rescaled to the norm of the same row of the weight, so the plot's scale is the weights'
own. 1-D parameters (biases, norm gains) get a zero direction, as in the paper. The loss is evaluated at
theta + a*d1 (+ b*d2) for a (and b) in linspace(-span, span, steps) on the given batches, averaged over
the data-parallel group when one is given, and the weights are restored bit-exactly afterwards (copied
back from a host copy, not subtracted).

Handles a plain module or a DeepSpeed engine's module under ZeRO 0-2 with tp=1 and pp=1; for ZeRO-3
(partitioned parameters), tensor parallelism (sharded rows) and pipeline stages (no stage holds the whole
model) it returns {"unavailable": reason} without touching the weights, and the chart says so.
Collective when `group` is given: every rank of the group calls it with the same seed, steps and batch
count.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any, Callable, Iterable, Optional

log = logging.getLogger(__name__)

METHOD = "random Gaussian directions, filter-normalised (Li et al. 2018); 1-D parameters zeroed"


def unavailable_reason(model: Any) -> Optional[str]:
    """Why the landscape cannot be computed for this model/engine, or None if it can."""
    engine = model if hasattr(model, "module") and hasattr(model, "zero_optimization_stage") else None
    module = engine.module if engine is not None else model
    if engine is not None:
        try:
            if int(engine.zero_optimization_stage()) >= 3:
                return "ZeRO-3 partitions the parameters: no rank holds the full weights to perturb"
        except Exception:
            pass
    if "deepspeed" in sys.modules:  # a PipelineModule cannot exist without it; don't pay the import
        try:
            from deepspeed.pipe import PipelineModule

            if isinstance(module, PipelineModule):
                return "pipeline parallel (pp>1): each stage holds only part of the model"
        except Exception:
            pass
    tp = getattr(module, "tp", None)
    if tp is not None and getattr(tp, "world_size", 1) > 1:
        return "tensor parallel (tp>1): weight rows are sharded across ranks, filter norms need the full rows"
    for p in module.parameters():
        if hasattr(p, "ds_id") or hasattr(p, "ds_status"):
            return "ZeRO-3 partitions the parameters: no rank holds the full weights to perturb"
    return None


def _direction(p: Any, gen: Any, row_norms: Any) -> Any:
    """A filter-normalised random direction for parameter p (fp32, on the generator's device): Gaussian,
    each row (filter / output unit) rescaled to the norm of the same row of the weight; zero for 1-D."""
    import torch

    if p.dim() <= 1:
        return torch.zeros(p.shape, dtype=torch.float32, device=gen.device)
    d = torch.randn(p.shape, generator=gen, device=gen.device, dtype=torch.float32)
    d_rows = d.reshape(d.shape[0], -1)
    d_norm = d_rows.norm(dim=1, keepdim=True).clamp_min(1e-12)
    d_rows.mul_(row_norms.to(d.device).reshape(-1, 1) / d_norm)
    return d


def _placement(device: Any, weight_bytes: int, dir_bytes: int) -> tuple[Any, bool, Optional[str]]:
    """(where the weight copy lives, whether to cache directions, reason it cannot run or None)."""
    import torch

    gib = float(1 << 30)
    if device.type == "cuda":
        try:
            free, _ = torch.cuda.mem_get_info(device)
        except Exception:
            free = 0
        if weight_bytes < 0.5 * free:
            store = device
            free -= weight_bytes
        else:
            store = torch.device("cpu")
        return store, dir_bytes < 0.5 * free, _host_check(weight_bytes if store.type == "cpu" else 0)
    cache = dir_bytes < 2 * gib
    return torch.device("cpu"), cache, _host_check(weight_bytes + (dir_bytes if cache else 0))


def _host_check(need: int) -> Optional[str]:
    """None if this node's free memory can hold `need` bytes for every local rank doing the same."""
    if need <= 0:
        return None
    try:
        import os

        import psutil

        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        avail = psutil.virtual_memory().available
        if need * local > 0.8 * avail:
            return (f"not enough host memory for the weight copy ({need / 2**30:.1f} GiB x {local} local ranks, "
                    f"{avail / 2**30:.1f} GiB available)")
    except Exception:
        pass
    return None


def _all_agree(ok: bool, group: Any, device: Any) -> bool:
    """True if every rank of the group has ok (collective when a group with more than one rank is given)."""
    import torch
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) <= 1:
        return ok
    flag = torch.tensor(1.0 if ok else 0.0, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item() > 0)


def loss_landscape(
    model: Any,
    batches: Iterable,
    loss_fn: Optional[Callable[[Any, Any, Any], Any]],
    seed: int,
    steps: int = 11,
    span: float = 1.0,
    two_d: bool = False,
    group: Any = None,
    max_batches: int = 4,
) -> dict[str, Any]:
    """Loss along one (or, with two_d, a plane of two) filter-normalised random directions.

    model: an nn.Module, or a DeepSpeed engine (its .module is used). batches: (inputs, labels) pairs
    (a few validation micro-batches; at most max_batches are used). loss_fn(module, x, y) -> scalar
    tensor; None: module(x, y). Returns {"alphas", "losses", "center_loss", ...} (and "betas", "grid"
    [len(betas) x len(alphas)] with two_d), or {"unavailable": reason}. Never raises.
    """
    try:
        reason = unavailable_reason(model)
        if reason:
            return {"unavailable": reason}
        module = model.module if hasattr(model, "module") and hasattr(model, "zero_optimization_stage") else model
        data = []
        for i, b in enumerate(batches):
            if i >= max_batches:
                break
            data.append(b)
        if not data:
            return {"unavailable": "no validation batches to evaluate the loss on"}
        return _landscape(module, data, loss_fn, seed, steps, span, two_d, group)
    except Exception as e:
        log.warning("loss landscape failed (%s); the chart will say so", e)
        return {"unavailable": f"computation failed: {type(e).__name__}: {e}"[:300]}


def _landscape(module, data, loss_fn, seed, steps, span, two_d, group) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    params = [p for p in module.parameters()]
    device = params[0].device if params else torch.device("cpu")
    steps = max(3, int(steps))
    alphas = [(-span + 2 * span * i / (steps - 1)) for i in range(steps)]
    n_dirs = 2 if two_d else 1

    # Memory: a copy of the weights (to restore them bit-exactly) on the device if it has room, else in
    # host memory; directions cached (fp32) only when small, else regenerated per point from per-parameter
    # seeds (same numbers either way). Every rank of the group must agree to go ahead, or none does.
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    dir_bytes = n_dirs * 4 * sum(p.numel() for p in params if p.dim() > 1)
    store, cache_dirs, reason = _placement(device, weight_bytes, dir_bytes)
    if not _all_agree(reason is None, group, device):
        return {"unavailable": reason or "another rank of the data-parallel group lacks memory for the probe"}
    originals = [p.detach().to(store, copy=True) for p in params]
    row_norms = [
        p.detach().float().reshape(p.shape[0], -1).norm(dim=1) if p.dim() > 1 else None for p in params
    ]

    def direction(i: int, k: int):
        p = params[i]
        # Per-parameter seed: regenerating one direction never depends on the others.
        gen = torch.Generator(device=p.device).manual_seed(
            (int(seed) * 1_000_003 + 7919 * (k + 1) + 104_729 * i) % 2**63)
        return _direction(p, gen, row_norms[i])

    cached = [[direction(i, k) for i in range(len(params))] for k in range(n_dirs)] if cache_dirs else None

    def dir_of(i: int, k: int):
        return cached[k][i] if cached is not None else direction(i, k)

    was_training = module.training
    module.eval()

    def set_point(a: float, b: float) -> None:
        for i, p in enumerate(params):
            if p.dim() <= 1:
                p.data.copy_(originals[i].to(p.device))
                continue
            w = originals[i].to(p.device, dtype=torch.float32) + a * dir_of(i, 0)
            if two_d:
                w = w + b * dir_of(i, 1)
            p.data.copy_(w.to(p.dtype))

    def evaluate() -> float:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for x, y in data:
            x, y = x.to(device), y.to(device)
            loss = loss_fn(module, x, y) if loss_fn is not None else module(x, y)
            total += loss.detach().double()
        total /= len(data)
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
            total /= dist.get_world_size(group)
        v = float(total.item())
        return v if math.isfinite(v) else float("nan")

    result: dict[str, Any] = {
        "method": METHOD,
        "seed": int(seed),
        "span": float(span),
        "steps": steps,
        "num_batches": len(data),
        "two_d": bool(two_d),
        "alphas": alphas,
    }
    try:
        with torch.no_grad():
            if two_d:
                grid = [[0.0] * steps for _ in range(steps)]
                for j, b in enumerate(alphas):
                    for i, a in enumerate(alphas):
                        set_point(a, b)
                        grid[j][i] = evaluate()
                result["betas"] = list(alphas)
                result["grid"] = grid
                mid = steps // 2
                result["losses"] = grid[mid] if steps % 2 else [None] * steps
                if steps % 2 == 0:  # the 1-D cut through b=0 needs its own pass
                    losses = []
                    for a in alphas:
                        set_point(a, 0.0)
                        losses.append(evaluate())
                    result["losses"] = losses
            else:
                losses = []
                for a in alphas:
                    set_point(a, 0.0)
                    losses.append(evaluate())
                result["losses"] = losses
    finally:
        try:
            with torch.no_grad():
                for p, o in zip(params, originals):
                    p.data.copy_(o.to(p.device))
        finally:
            module.train(was_training)
    # The restored weights, bit for bit: alpha = 0 is the trained model itself.
    result["center_loss"] = result["losses"][steps // 2] if steps % 2 else None
    result["seconds"] = time.perf_counter() - t0
    return result
