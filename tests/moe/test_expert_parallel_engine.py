"""Expert parallelism through the real DeepSpeed engine (gloo, fp32, rtol = atol = 1e-5): a Mixtral-shaped ep2
engine built by rayspeed's engine builder (DeepSpeed's mpu: rayspeed.parallel.expert_parallel.DeepSpeedView) trains
as the engine with every expert on every rank, on the same weights and each rank's own tokens (dp2 at ZeRO 0 and 1;
dp4, so that ZeRO partitions over the two ranks holding the same experts, at ZeRO 2 and 3): each
rank's loss of every step, every gradient of the first step after DeepSpeed's reduction (an expert's: its rows of
the unsplit engine's), the first step's global gradient norm, and the weights after the steps. On four ranks also
tp2 x ep2 (each expert's width split over tp, as the dense MLP's) against the dp4 engine on the same tokens."""

from __future__ import annotations

import pytest

from _deepspeed_world import _init_deepspeed
from _dist import run_distributed

TOL = dict(rtol=1e-5, atol=1e-5)
MODEL = dict(architecture="MixtralForCausalLM", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=48, vocab_size=256, seq_len=16, num_experts=4, router_aux_loss_coef=0.1)
STEPS = 2
LR = 3e-5  # Adam moves a weight by about lr whatever its gradient: small, so near-zero gradients flip nothing


def _cfg(ep, zero, world, tp=1):
    from rayspeed.config import parse

    return parse({
        "name": "ep", "model": MODEL,
        "train": {"global_batch_size": 2 * world // tp, "precision": "fp32", "max_steps": 10, "warmup_steps": 0,
                  "lr": LR},
        "parallel": dict(dp=world // tp, ep=ep, tp=tp, pp=1, cp=1, zero_stage=zero, micro_batch_size=2, grad_accum=1,
                         sequence_parallel=tp > 1, activation_checkpointing="none"),
        "cluster": {"num_workers": world},
    })


def _run(engine, rank, groups=None):
    """rank: which tokens (the data-parallel replica's); groups: a tp layout's, whose shards are gathered."""
    import torch
    from deepspeed.utils import safe_get_full_grad

    from rayspeed.engine.clip import global_grad_norm
    from rayspeed.parallel.layers import gather_full

    def whole(value, p):
        return gather_full(value, p, groups.tp) if groups is not None else value.detach()

    losses, grads, norm = [], {}, None
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, 256, (2, MODEL["seq_len"] + 1), generator=g)
        loss = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(loss)
        if step == 0:
            for name, p in engine.module.named_parameters():
                full = safe_get_full_grad(p)
                grads[name] = whole(p.grad if full is None else full, p).clone()
            if engine.zero_optimization_stage() == 0:  # no DeepSpeed norm: the worker's own (rayspeed.engine.clip)
                norm = float(global_grad_norm(engine.module.parameters(),
                                              tp_group=groups.tp_group if groups is not None else None))
        engine.step()
        if step == 0 and norm is None:
            norm = float(engine.get_global_grad_norm())
        losses.append(float(loss.detach()))
    weights = {n: whole(p, p).clone() for n, p in engine.module.named_parameters()}
    return losses, grads, norm, weights


def _ep_engine_against_dp(rank, world, zero):
    import torch

    from rayspeed.engine.build import build_engine
    from rayspeed.engine.deepspeed_config import deepspeed_config
    from rayspeed.parallel.groups import ParallelGroups

    _init_deepspeed()
    out = {}
    for ep in (1, 2):
        cfg = _cfg(ep, zero, world)
        groups = ParallelGroups(dp=world, tp=1, pp=1, ep=ep)
        engine, _ = build_engine(cfg, deepspeed_config(cfg), groups, torch.device("cpu"))
        out[ep] = _run(engine, rank)
        held = groups.ep.local_experts(MODEL["num_experts"]) if ep > 1 else None
    if world == 4 and zero < 3:  # tp2 x ep2 (dp2): a tp pair reads the tokens ranks 2r and 2r + 1 read at dp4
        cfg = _cfg(1, zero, world)
        groups = ParallelGroups(dp=world, tp=1, pp=1)
        engine, _ = build_engine(cfg, deepspeed_config(cfg), groups, torch.device("cpu"))
        out["tp_reference"] = _run(engine, rank // 2)
        cfg = _cfg(2, zero, world, tp=2)
        groups = ParallelGroups(dp=2, tp=2, pp=1, ep=2)
        engine, _ = build_engine(cfg, deepspeed_config(cfg), groups, torch.device("cpu"))
        out["tp2"] = _run(engine, groups.dp_rank, groups)
        tp_held = groups.ep.local_experts(MODEL["num_experts"])
        out["tp_held"] = (tp_held.start, tp_held.stop)
    return {"out": out, "held": (held.start, held.stop)}


def _stages(rank, world, zeros):
    return {zero: _ep_engine_against_dp(rank, world, zero) for zero in zeros}


@pytest.fixture(scope="module")
def worlds():
    """Each world started once for its ZeRO stages: dp2 for 0 and 1, dp4 for 0 (tp2 x ep2 only), 2 and 3."""
    return {world: run_distributed(_stages, world, zeros, timeout_s=240)
            for world, zeros in ((2, (0, 1)), (4, (0, 2, 3)))}


@pytest.mark.parametrize("zero,world", [(0, 2), (1, 2), (2, 4), (3, 4)])
def test_ep2_engine_trains_as_every_expert_on_every_rank(worlds, zero, world):
    import torch

    for rank, r in enumerate(by_zero[zero] for by_zero in worlds[world]):
        (l1, g1, n1, w1), (l2, g2, n2, w2) = r["out"][1], r["out"][2]
        lo, hi = r["held"]
        assert l2 == pytest.approx(l1, rel=1e-5, abs=1e-5), (rank, l1, l2)
        # The first step's norm: DeepSpeed's at ZeRO 1-2 (experts summed over its model-parallel group), rayspeed's
        # at ZeRO-0 (over the ep group).
        assert n2 == pytest.approx(n1, rel=1e-5), (rank, n1, n2)
        experts = [n for n in w2 if n.endswith(("w_gate", "w_up", "w_down"))]
        assert experts and w2[experts[0]].shape[0] == hi - lo
        for name in w2:
            want_g, want_w = (g1[name][lo:hi], w1[name][lo:hi]) if name in experts else (g1[name], w1[name])
            torch.testing.assert_close(g2[name], want_g, **TOL, msg=lambda m: f"rank {rank} grad {name}: {m}")
            torch.testing.assert_close(w2[name], want_w, **TOL, msg=lambda m: f"rank {rank} weight {name}: {m}")


@pytest.mark.parametrize("zero", [0, 2])  # ZeRO-3 with ep x tp: refused (config/moe_keys.py)
def test_tp2_ep2_engine_trains_as_every_expert_whole_on_every_rank(worlds, zero):
    """Each expert's width over tp2 (sequence parallel) and the experts over ep2, 4 ranks: losses, the first step's
    gradients and norm, and the weights after the steps (gathered over tp) as the dp engine's."""
    import torch

    for rank, r in enumerate(by_zero[zero] for by_zero in worlds[4]):
        (l1, g1, n1, w1), (l2, g2, n2, w2) = r["out"]["tp_reference"], r["out"]["tp2"]
        lo, hi = r["out"]["tp_held"]
        assert l2 == pytest.approx(l1, rel=1e-5, abs=1e-5), (rank, l1, l2)
        assert n2 == pytest.approx(n1, rel=1e-5), (rank, n1, n2)
        experts = [n for n in w2 if n.endswith(("w_gate", "w_up", "w_down"))]
        assert experts and w2[experts[0]].shape[:2] == (hi - lo, w1[experts[0]].shape[1])
        for name in w2:
            want_g, want_w = (g1[name][lo:hi], w1[name][lo:hi]) if name in experts else (g1[name], w1[name])
            torch.testing.assert_close(g2[name], want_g, **TOL, msg=lambda m: f"rank {rank} grad {name}: {m}")
            torch.testing.assert_close(w2[name], want_w, **TOL, msg=lambda m: f"rank {rank} weight {name}: {m}")
