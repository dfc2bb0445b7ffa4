"""Context parallelism through the real DeepSpeed engine (2 gloo ranks, fp32): a cp2 engine, built by rayspeed's
engine builder with ParallelGroups as DeepSpeed's mpu, trains exactly as one unsplit rank on the same sequences:
the loss (summed over the cp group) of every step and the weights after them equal the single-rank engine's at
rtol = atol = 1e-5, and so does every gradient of the first step, at ZeRO 0, 1, 2 and 3 (DeepSpeed reduces over
dp x cp and divides by dp, so the gradients of the two halves of each sequence add up; under ZeRO-3 with the loss
scale rayspeed.compat.cp_loss_scale gives). A checkpoint written at cp2 resumes exactly at cp2, and one written at
dp2 continues at dp1 x cp2 through DeepSpeed's universal conversion (cp is part of the ZeRO partition)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _deepspeed_world import SoloGroups, _init_deepspeed
from _dist import run_distributed

TOL = dict(rel=1e-5, abs=1e-5)
MODEL = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64, vocab_size=256, seq_len=32)
STEPS = 3
# Adam moves every weight by about lr whatever its gradient's size, so a gradient equal to 1e-7 relative but near
# zero can flip an update: a small lr keeps later steps comparable at 1e-5 (the gradients are compared directly).
LR = 3e-5


def _cfg(cp, zero, dp=1):
    from rayspeed.config import parse

    return parse({
        "name": "cp", "model": MODEL,
        "train": {"global_batch_size": 2, "precision": "fp32", "max_steps": 10, "warmup_steps": 0, "lr": LR},
        "parallel": dict(dp=dp, tp=1, pp=1, cp=cp, cp_scheme="ring" if zero == 1 else "ulysses", zero_stage=zero,
                         micro_batch_size=2 // dp, grad_accum=1, sequence_parallel=False,
                         activation_checkpointing="none"),
        "cluster": {"num_workers": cp * dp},
    })


def _batch(step, prompt=True):
    import torch

    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 256, (2, MODEL["seq_len"]), generator=g)
    labels = torch.randint(0, 256, (2, MODEL["seq_len"]), generator=g)
    if prompt:
        labels[1, :7] = -100  # a prompt: the divisor is the whole sequence's label count
    return ids, labels


def _train(engine, groups, steps, start=0, grads=None):
    """Losses of `steps` steps; `grads` (a dict) gets every parameter's whole gradient of the first one."""
    from deepspeed.utils import safe_get_full_grad

    from rayspeed import compat
    from rayspeed.train.evaluation import local_part, over_cp

    cp = getattr(groups, "cp", None)
    scale = compat.cp_loss_scale(engine.zero_optimization_stage(), cp.world_size if cp is not None else 1)
    out = []
    for s in range(start, start + steps):
        loss = engine(*local_part(_batch(s), cp, "cpu"))
        engine.backward(loss * scale)
        if grads is not None and s == start:
            for name, p in engine.module.named_parameters():
                g = safe_get_full_grad(p)
                grads[name] = (p.grad if g is None else g).detach().clone()
        engine.step()
        out.append(float(over_cp(loss.detach(), cp)))
    return out


def _weights(engine):
    import deepspeed

    out = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
            out[name] = p.detach().clone()
    return out


def _world(rank, world_size, root):
    import deepspeed
    import torch

    from rayspeed.engine.build import build_engine, build_model
    from rayspeed.engine.deepspeed_config import deepspeed_config
    from rayspeed.engine.optim import build_optimizer
    from rayspeed.parallel.groups import ParallelGroups

    _init_deepspeed()
    solo_groups = SoloGroups()
    results = {}
    for zero in (0, 1, 2, 3):
        torch.manual_seed(0)
        cfg = _cfg(1, zero)
        model = build_model(cfg, solo_groups)
        solo, _, _, _ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, cfg, False),
                                             config=deepspeed_config(cfg), mpu=solo_groups)
        want_g: dict = {}
        want = _train(solo, None, STEPS, grads=want_g)
        want_w = _weights(solo)
        cfg = _cfg(2, zero)
        groups = ParallelGroups(1, 1, 1, cp=2, cp_scheme=cfg.parallel.cp_scheme)
        engine, _ = build_engine(cfg, deepspeed_config(cfg), groups, torch.device("cpu"))
        got_g: dict = {}
        got = _train(engine, groups, STEPS, grads=got_g)
        got_w = _weights(engine)
        res = {"losses": (got, want), "weights": {n: float((got_w[n] - want_w[n]).abs().max()) for n in want_w},
               "grads": {n: (float((got_g[n] - want_g[n]).abs().max()), float(want_g[n].abs().max())) for n in want_g},
               "seq_dp": engine.seq_dp_world_size, "dp": engine.dp_world_size}
        if zero == 2:  # resume at cp2 from a cp2 checkpoint: the next steps equal the uninterrupted ones
            engine.save_checkpoint(root, tag="cp2")
            more = _train(engine, groups, 2, start=STEPS)
            fresh, _ = build_engine(cfg, deepspeed_config(cfg), groups, torch.device("cpu"))
            fresh.load_checkpoint(root, tag="cp2")
            res["resume"] = (_train(fresh, groups, 2, start=STEPS), more)
        results[zero] = res
    for zero in (2, 3):
        results[f"resize{zero}"] = _dp2_to_cp2(rank, Path(root) / f"resize{zero}", zero)
    return results


def _dp2_to_cp2(rank, root, zero):
    """dp2 (each rank one sequence of every step) -> checkpoint -> universal conversion -> dp1 x cp2 (each rank half
    of both): the losses continue the uninterrupted dp2 run's. Every label counts, so the mean of the two ranks'
    means is the mean over both sequences."""
    import torch
    import torch.distributed as dist

    from rayspeed import compat
    from rayspeed.checkpoint.resume import convert_to_universal
    from rayspeed.engine.build import build_engine
    from rayspeed.engine.deepspeed_config import deepspeed_config
    from rayspeed.engine.deepspeed_state import DeepSpeedState, with_universal_load
    from rayspeed.parallel.groups import ParallelGroups
    from rayspeed.train.evaluation import local_part, over_cp

    def dp2_step(engine, s):
        ids, labels = _batch(s, prompt=False)
        loss = engine(ids[rank:rank + 1], labels[rank:rank + 1])
        engine.backward(loss)
        engine.step()
        v = loss.detach().double()
        dist.all_reduce(v)
        return float(v) / 2

    cfg = _cfg(1, zero, dp=2)
    dp2, _ = build_engine(cfg, deepspeed_config(cfg), ParallelGroups(2, 1, 1), torch.device("cpu"))
    for s in range(STEPS):
        dp2_step(dp2, s)
    DeepSpeedState(dp2).save(root, {"step": STEPS})
    dist.barrier()
    if rank == 0:
        convert_to_universal(root)
    dist.barrier()
    want = [dp2_step(dp2, s) for s in range(STEPS, STEPS + 2)]
    cfg = _cfg(2, zero)
    groups = ParallelGroups(1, 1, 1, cp=2)
    cp2, _ = build_engine(cfg, with_universal_load(deepspeed_config(cfg)), groups, torch.device("cpu"))
    client = DeepSpeedState(cp2).load(root, universal=True)
    scale = compat.cp_loss_scale(zero, 2)
    got = []
    for s in range(STEPS, STEPS + 2):
        loss = cp2(*local_part(_batch(s, prompt=False), groups.cp, "cpu"))
        cp2.backward(loss * scale)
        cp2.step()
        got.append(float(over_cp(loss.detach(), groups.cp)))
    return {"step": client["step"], "losses": (got, want)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_world, 2, str(tmp_path_factory.mktemp("cp-ckpt")), timeout_s=300)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_a_cp2_engine_trains_like_one_unsplit_rank(results, zero):
    for rank in results:
        res = rank[zero]
        got, want = res["losses"]
        assert got == pytest.approx(want, **TOL)
        assert all(scale > 0 for _, scale in res["grads"].values())
        for name, (diff, scale) in res["grads"].items():
            assert diff <= TOL["abs"] + TOL["rel"] * scale, (name, diff, scale)
        assert max(res["weights"].values()) <= 1e-5, res["weights"]
        assert (res["seq_dp"], res["dp"]) == (2, 1)  # ZeRO spans dp x cp; the batch size counts dp only


def test_a_cp2_checkpoint_resumes_exactly(results):
    for rank in results:
        got, want = rank[2]["resume"]
        assert got == pytest.approx(want, **TOL)


@pytest.mark.parametrize("zero", [2, 3])
def test_a_dp2_checkpoint_continues_at_cp2_through_the_universal_conversion(results, zero):
    for rank in results:
        res = rank[f"resize{zero}"]
        assert res["step"] == STEPS
        got, want = res["losses"]
        assert got == pytest.approx(want, **TOL)
