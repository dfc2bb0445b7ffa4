"""health.watchdog: skip withholds the update, under every optimizer path DeepSpeed takes: ZeRO-0 fp32 (the
worker's clipper, or its own norm without clipping), ZeRO-1, 2 and 3, bf16, tensor and pipeline parallelism. A NaN
step leaves the weights (the loss on a fixed batch, bit for bit) and Adam's step count as they were; the next good
step is applied. Real engines in one 2-process gloo world."""

from __future__ import annotations

import math

import pytest
import torch

from _dist import run_distributed

MODEL = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64, vocab_size=256, seq_len=16)
LAYOUTS = {  # name: (dp, tp, pp, zero, precision, grad_clip); the pipeline first: its engine takes no mpu
    "pp2-zero0": (1, 1, 2, 0, "fp32", 1.0),
    "zero0-clipper": (2, 1, 1, 0, "fp32", 1.0),
    "zero0-noclip": (2, 1, 1, 0, "fp32", 0.0),
    "zero1": (2, 1, 1, 1, "fp32", 1.0),
    "zero2-bf16": (2, 1, 1, 2, "bf16", 1.0),
    "zero3": (2, 1, 1, 3, "fp32", 1.0),
    "tp2-zero1": (1, 2, 1, 1, "fp32", 1.0),
}


def _cfg(dp, tp, pp, zero, precision, clip):
    from rayspeed.config import parse

    return parse({"name": "guard", "model": MODEL,
                  "train": {"global_batch_size": 2 * dp, "precision": precision, "max_steps": 10, "warmup_steps": 0,
                            "lr": 1e-2, "grad_clip": clip},
                  "parallel": dict(dp=dp, tp=tp, pp=pp, zero_stage=zero, micro_batch_size=2, grad_accum=1,
                                   sequence_parallel=False, activation_checkpointing="none"),
                  "cluster": {"num_workers": dp * tp * pp}})


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (2, MODEL["seq_len"]), generator=g),
            torch.randint(0, 256, (2, MODEL["seq_len"]), generator=g))


def _world(rank, world_size):
    import logging

    import deepspeed

    from rayspeed.compat import skip_deepspeed_shm_comm_op
    from rayspeed.engine.build import build_engine
    from rayspeed.engine.clip import GradClipper, global_grad_norm
    from rayspeed.engine.deepspeed_config import deepspeed_config, rayspeed_clips
    from rayspeed.health.watchdog import Watchdog
    from rayspeed.parallel.groups import ParallelGroups
    from rayspeed.train.step_guard import StepGuard

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    skip_deepspeed_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for name, spec in LAYOUTS.items():
        cfg = _cfg(*spec)
        dp, tp, pp = spec[:3]
        groups = ParallelGroups(dp, tp, pp)
        engine, pipelined = build_engine(cfg, deepspeed_config(cfg), groups, torch.device("cpu"))
        clipper = GradClipper(engine.module.parameters(), cfg.train.grad_clip, groups.tp_group) \
            if rayspeed_clips(cfg) else None
        state = {"norm": None}
        means: list = []  # per good step: (this rank's loss, the guard's data-parallel mean, whether it rode)

        def own_norm(engine=engine, groups=groups, clipper=clipper, state=state):
            if clipper is not None:
                return state["norm"]
            return global_grad_norm(engine.module.parameters(), groups.tp_group, groups.pp_group)

        guard = StepGuard(Watchdog("skip", max_skips=5), engine, groups, own_norm)
        data_seed = 100 * (rank if dp > 1 else 0)

        def step(i, poison=False, engine=engine, pipelined=pipelined, guard=guard, clipper=clipper, state=state):
            x, y = _batch(data_seed + i)
            if pipelined:
                engine.module.loss_fn.scale = float("nan") if poison else None
                guard.arm(i, None)
                engine.train_batch(iter([(x, y)]))
                engine.module.loss_fn.scale = None
                return guard.settle()
            loss = engine(x, y)
            if poison:
                loss = loss * float("nan")
            guard.arm(i, loss)  # before the backward, as TrainStep arms it (under ZeRO-0 the loss rides in it)
            engine.backward(loss)
            carried = guard.rider is not None and guard.rider.carried
            if clipper is not None:
                state["norm"] = clipper()
            engine.step()
            decision = guard.settle()
            means.append((float(loss), float(guard._loss_tensor), carried))
            return decision

        def probe(engine=engine, pipelined=pipelined):
            x, y = _batch(999)
            with torch.no_grad():
                if pipelined:
                    return float(engine.eval_batch(iter([(x, y)])))
                return float(engine(x, y))

        def adam_steps(engine=engine):
            client = guard_client(engine)
            return sorted({float(s["step"]) for s in client.state.values() if "step" in s})

        for i in range(3):
            step(i)
        before, steps_before = probe(), adam_steps()
        skipped = (step(3, poison=True).action, probe(), adam_steps())
        after = (step(4).action, probe(), adam_steps())
        out[name] = {"before": before, "steps_before": steps_before, "skipped": skipped, "after": after,
                     "means": [m for m in means if math.isfinite(m[0])]}
    return out


def guard_client(engine):
    opt = engine.optimizer
    return opt if isinstance(opt, torch.optim.Optimizer) else opt.optimizer


@pytest.fixture(scope="module")
def results():
    return run_distributed(_world, 2, timeout_s=120)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_nan_step_is_not_applied_and_the_next_one_is(results, name):
    for rank, per_rank in enumerate(results):
        r = per_rank[name]
        action, loss, steps = r["skipped"]
        assert action == "skip", (name, rank, r)
        assert loss == r["before"] and math.isfinite(loss), (name, rank, r)  # weights as they were, bit for bit
        assert steps == r["steps_before"], (name, rank, r)  # Adam's moments and count untouched
        action, loss, steps = r["after"]
        assert action == "ok" and loss != r["before"] and math.isfinite(loss), (name, rank, r)
        assert steps == [s + 1 for s in r["steps_before"]], (name, rank, r)


@pytest.mark.parametrize("name", [n for n, spec in LAYOUTS.items() if spec[0] > 1])
def test_the_guard_decides_on_the_data_parallel_mean_loss(results, name):
    """Both ranks see the mean of their two losses; under ZeRO-0 it rode in the gradient all-reduce (no collective of
    its own), elsewhere the guard reduced it alone."""
    zero = LAYOUTS[name][3]
    mine, other = (r[name]["means"] for r in results)
    assert len(mine) == len(other) == 4, name
    for (loss0, mean0, carried0), (loss1, mean1, carried1) in zip(mine, other):
        assert mean0 == pytest.approx((loss0 + loss1) / 2, rel=1e-6, abs=1e-6) and mean1 == mean0, name
        assert carried0 == carried1 == (zero == 0), name

