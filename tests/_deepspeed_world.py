"""The one 2-process gloo world with DeepSpeed that tests/monitoring and tests/model share (process start-up
and the DeepSpeed import dominate, so it runs once per session): the monitoring checks and the model exports of
every layout."""

from __future__ import annotations

import importlib
import logging
import time
from types import SimpleNamespace

import torch

from _dist import run_distributed
from rayspeed.compat import skip_deepspeed_shm_comm_op
from rayspeed.monitoring.comm_timer import CommTimer
from rayspeed.monitoring.landscape import loss_landscape
from rayspeed.monitoring.system import SystemSampler
from rayspeed.monitoring.system_gather import gather_system_metrics

MODEL = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64, vocab_size=256, seq_len=16)


def job_cfg(dp, tp=1, pp=1, zero=2, precision="fp32"):
    from rayspeed.config import parse

    return parse({
        "name": "mon", "model": MODEL,
        "train": {"global_batch_size": 2 * dp, "precision": precision, "max_steps": 10, "warmup_steps": 0, "lr": 1e-2},
        "parallel": dict(dp=dp, tp=tp, pp=pp, zero_stage=zero, micro_batch_size=2, grad_accum=1,
                         sequence_parallel=False, activation_checkpointing="none"),
        "cluster": {"num_workers": dp * tp * pp},
    })


def _batch(seed, b=2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (b, MODEL["seq_len"]), generator=g),
            torch.randint(0, 256, (b, MODEL["seq_len"]), generator=g))


def _init_deepspeed():
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    skip_deepspeed_shm_comm_op()  # CPU accelerator: skip the JIT-built inference op
    deepspeed.init_distributed(dist_backend="gloo")


class SoloGroups:
    """DeepSpeed mpu where every rank is its own data-parallel world (dp=1 replicas side by side)."""

    def __init__(self):
        import torch.distributed as dist

        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective: all ranks, all groups
        self.group = groups[dist.get_rank()]

    def get_data_parallel_group(self):
        return self.group

    get_model_parallel_group = get_tensor_model_parallel_group = get_data_parallel_group

    def get_data_parallel_rank(self):
        return 0

    get_model_parallel_rank = get_tensor_model_parallel_rank = get_data_parallel_rank

    def get_data_parallel_world_size(self):
        return 1

    get_model_parallel_world_size = get_tensor_model_parallel_world_size = get_data_parallel_world_size


def _world(rank, world_size, export_root):
    """Everything that needs a DeepSpeed world, in one 2-process spawn for both test modules (start-up and
    the DeepSpeed import dominate): the monitoring checks here, the model exports of test_model_export."""
    import deepspeed
    import torch.distributed as dist

    _init_deepspeed()
    exports = export_layouts(rank, export_root)  # first: its pipeline engine must precede any mpu
    from rayspeed.engine.build import build_engine, build_model
    from rayspeed.engine.deepspeed_config import deepspeed_config
    from rayspeed.engine.optim import build_optimizer
    from rayspeed.parallel.groups import ParallelGroups

    out = {}
    sampler = SystemSampler(rank, node_id=f"host-{'ab'[rank]}", interval_s=0.05)

    # --- ZeRO-2 over dp=2: measured gradient-sync time, only on measured steps
    cfg = job_cfg(dp=2)
    groups = ParallelGroups(2, 1, 1)
    engine, _ = build_engine(cfg, deepspeed_config(cfg), groups, torch.device("cpu"))
    timer = CommTimer()
    cdb = importlib.import_module("deepspeed.comm.comm").cdb
    lasts = []
    for step in range(3):
        x, y = _batch(100 * rank + step)
        with timer.step(measure=step >= 1):
            patched_inside = "all_reduce" in vars(cdb) or "reduce_scatter_tensor" in vars(cdb)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        lasts.append(timer.last())
        out.setdefault("patched_inside", []).append(patched_inside)
    out["zero2"] = lasts
    out["zero2_metrics"] = timer.metrics()
    out["patched_after"] = any(n in vars(cdb)
                               for n in ("all_reduce", "reduce", "reduce_scatter_tensor", "all_gather_into_tensor"))
    with timer.step(measure=False):
        pass
    out["unmeasured_keeps_last"] = timer.last() == lasts[-1]

    # --- system metrics: every rank's snapshot reaches rank 0, grouped by node
    time.sleep(0.2)
    snap = sampler.snapshot()
    snap.update({"grad_sync_fraction": lasts[-1]["grad_sync_fraction"]})
    out["gathered"] = gather_system_metrics(snap, groups)
    out["snapshot_keys"] = sorted(snap)
    # Later gathers with the same names send numbers only; a new name gathers the snapshots as objects once more.

    objects = dist.all_gather_object
    calls = []
    dist.all_gather_object = lambda *a, **k: (calls.append(1), objects(*a, **k))[1]
    try:
        out["gathered2"] = gather_system_metrics(dict(snap, cpu_percent=11.0 + rank), groups)
        out["object_gathers2"] = len(calls)
        out["gathered3"] = gather_system_metrics(dict(snap, comm_s=0.5 + rank), groups)
        out["object_gathers3"] = len(calls)
    finally:
        dist.all_gather_object = objects
    sampler.stop()

    # --- loss landscape around the engine's weights: identical on both ranks, weights restored bit-exactly
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    batches = [_batch(1000 + 10 * rank + i) for i in range(2)]
    res = loss_landscape(engine, batches, None, seed=7, steps=5, span=0.5, group=groups.dp_group)
    out["landscape"] = res
    out["restored"] = all(torch.equal(before[n], p.detach()) for n, p in engine.module.named_parameters())
    with torch.no_grad():
        local = torch.stack([engine.module(x, y) for x, y in batches]).mean().double()
    dist.all_reduce(local, group=groups.dp_group)
    out["direct_loss"] = float(local / 2)
    x, y = _batch(555 + rank)  # training goes on afterwards
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    out["after_loss"] = float(loss)

    # --- dp=1 (each rank its own replica): no gradient crosses ranks, the measured fraction is 0
    solo_cfg = job_cfg(dp=1)
    model = build_model(solo_cfg, SimpleNamespace(tp=None))
    ds = deepspeed_config(solo_cfg)
    solo, _, _, _ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, solo_cfg, False), config=ds,
                                         mpu=SoloGroups())
    solo_timer = CommTimer()
    for step in range(2):
        x, y = _batch(7 + step)
        with solo_timer.step(measure=True):
            loss = solo(x, y)
            solo.backward(loss)
            solo.step()
    out["dp1"] = solo_timer.last()
    out["dp1_ops"] = solo_timer.breakdown
    out["exports"] = exports
    return out


_SHARED: dict = {}


def shared_world(tmp_path_factory):
    """The 2-process world's per-rank results, computed once per test session."""
    if "results" not in _SHARED:
        root = tmp_path_factory.mktemp("export")
        _SHARED["results"] = run_distributed(_world, 2, str(root), timeout_s=240)
    return _SHARED["results"]


def _train(engine, rank, steps=2, pipelined=False):
    for s in range(steps):
        if pipelined:
            engine.train_batch(iter([_batch(50 + s)]))
        else:
            x, y = _batch(10 * rank + s)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()


def export_layouts(rank, root):
    """In the shared 2-process world (test_monitoring._world): per layout, train a little, export
    (collective), and remember the engine's own loss on one batch."""
    from rayspeed.engine.build import build_engine
    from rayspeed.engine.deepspeed_config import deepspeed_config
    from rayspeed.model.export import export_model
    from rayspeed.parallel.groups import ParallelGroups

    out = {}
    x, y = _batch(999)
    for name, (dp, tp, pp, zero, precision) in {
        "pp2": (1, 1, 2, 1, "fp32"),  # first: the pipeline engine takes no mpu
        "zero2": (2, 1, 1, 2, "fp32"),
        "bf16": (2, 1, 1, 2, "bf16"),
        "tp2": (1, 2, 1, 1, "fp32"),
        "zero3": (2, 1, 1, 3, "fp32"),
    }.items():
        cfg = job_cfg(dp, tp, pp, zero, precision)
        groups = ParallelGroups(dp, tp, pp)
        engine, pipelined = build_engine(cfg, deepspeed_config(cfg), groups, torch.device("cpu"))
        _train(engine, rank, pipelined=pipelined)
        with torch.no_grad():
            if pipelined:
                engine_loss = float(engine.eval_batch(iter([(x, y)])))
            else:
                engine.eval()
                engine_loss = float(engine(x, y).float())  # the engine's forward (ZeRO-3 gathers)
                engine.train()
        path = export_model(engine, cfg, f"{root}/{name}", groups=groups)
        entry = {"path": path, "engine_loss": engine_loss}
        if name in ("zero3", "tp2", "pp2"):  # layouts the landscape declines, on the real engines
            from rayspeed.monitoring.landscape import loss_landscape

            entry["landscape"] = loss_landscape(engine, [(x, y)], None, seed=1)
        if name == "bf16":
            from deepspeed.utils import safe_get_full_fp32_param

            p = engine.module.layers[0].attn.wq.weight
            entry["master"] = safe_get_full_fp32_param(p).detach().clone()
            entry["bf16_dtype"] = str(p.dtype)
        out[name] = entry
    return out


def train_steps(cfg, engine, pipelined, groups, steps):
    """rayspeed's TrainStep over `steps` ((micro-batches, loss scale or None) per step) on an engine build_engine
    made: (each step's loss, the first step's gradients as reduced by Transformer name, before the update, the
    weights after the last step)."""
    from rayspeed.model.decoder import canonical_named_parameters
    from rayspeed.train.objective import LanguageModel
    from rayspeed.train.step import StepReadings, TrainStep
    from rayspeed.train.step_guard import NO_GUARD

    named = list(canonical_named_parameters(engine.module) if pipelined else engine.module.named_parameters())
    grads: dict = {}

    def keep(optimizer, args, kwargs):  # at the first step: the gradients as reduced, before the update
        if not grads:
            grads.update({n: p.grad.detach().clone() for n, p in named})

    hook = step_of_zero1 = None
    if cfg.parallel.zero_stage == 0:
        hook = engine.optimizer.register_step_pre_hook(keep)
    elif cfg.parallel.zero_stage == 1:
        # ZeRO-1 drops p.grad once reduced and keeps the averaged gradients flat and partitioned over the data-
        # parallel ranks until its step frees them: each full gradient is reassembled (a collective over the
        # data-parallel group, in the same parameter order on every rank) just before that step.
        from deepspeed.utils import safe_get_full_grad

        step_of_zero1 = engine.optimizer.step

        def step_keeping(*args, **kwargs):
            if not grads:
                grads.update({n: safe_get_full_grad(p).detach().clone() for n, p in named})
            return step_of_zero1(*args, **kwargs)

        engine.optimizer.step = step_keeping
    chaos = SimpleNamespace(poisons_loss=lambda step: False)
    scales = [scale for _, scale in steps]
    device = torch.device("cpu")
    objective = LanguageModel(None, scales.__getitem__, device, getattr(groups, "cp", None), cfg.parallel.zero_stage)
    step = TrainStep(engine, objective, StepReadings(engine, pipelined), NO_GUARD, chaos, None, device, pipelined)
    losses = [float(step.run(micro, s, s + 1)) for s, (micro, _) in enumerate(steps)]
    if hook is not None:
        hook.remove()
    if step_of_zero1 is not None:
        del engine.optimizer.step
    return losses, grads, {n: p.detach().clone() for n, p in named}
