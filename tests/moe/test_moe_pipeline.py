"""A mixture of experts under the pipeline engine (2 gloo ranks, fp32, rtol = atol = 1e-5): a pp2 engine built by
rayspeed's engine builder, stepped by rayspeed's TrainStep with two micro-batches per step, trains exactly as one
unsplit rank on the same sequences: the (language-model) loss of every step, every gradient of the first step (the
balance loss's included: it pools the routing of the MoE layers of both stages, and its gradient reaches the first
stage's routers), the weights after the last step, the validation loss and the mean balance loss of the training
forwards. Three cases: a Mixtral of 2 layers at ZeRO-0 (one MoE layer per stage), a Qwen3-MoE of 3 layers whose
middle layer is dense at ZeRO-1 under the token-weighted loss scale, and one whose first stage is dense only."""

from __future__ import annotations

import pytest

from _deepspeed_world import SoloGroups, _init_deepspeed, train_steps
from _dist import run_distributed

TOL = dict(rel=1e-5, abs=1e-5)
COMMON = dict(hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=48, vocab_size=256, seq_len=16,
              tie_embeddings=False, num_experts=4, experts_per_token=2, router_aux_loss_coef=0.1)
CASES = {
    "mixtral-zero0-mean": (dict(architecture="MixtralForCausalLM", num_layers=2), 0, False),
    "qwen3_moe-zero1-weighted": (dict(architecture="Qwen3MoeForCausalLM", num_layers=3, head_dim=16,
                                      expert_ffn_hidden_size=24, norm_topk_prob=False, moe_layers=[0, 2]), 1, True),
    # the first stage holds dense layers only: its statistics start at zero and still take their gradient
    "qwen3_moe-dense-first-stage": (dict(architecture="Qwen3MoeForCausalLM", num_layers=3, head_dim=16,
                                         expert_ffn_hidden_size=24, moe_layers=[2]), 0, False),
}
STEPS, MB, GA = 2, 2, 2
LR = 3e-5  # small: Adam's steps stay comparable at 1e-5 after the first


def _cfg(case, pp):
    from rayspeed.config import parse

    model, zero, _ = CASES[case]
    return parse({
        "name": "moe-pp", "model": {**COMMON, **model},
        "train": {"global_batch_size": MB * GA, "precision": "fp32", "max_steps": 10, "warmup_steps": 0, "lr": LR,
                  "grad_clip": 0.0},
        "parallel": dict(dp=1, tp=1, pp=pp, cp=1, ep=1, zero_stage=zero, micro_batch_size=MB, grad_accum=GA,
                         sequence_parallel=False, activation_checkpointing="none"),
        "health": {"watchdog": "off"},
        "cluster": {"num_workers": pp},
    })


def _micro_batches(step):
    import torch

    out = []
    for m in range(GA):
        g = torch.Generator().manual_seed(100 * step + m)
        ids = torch.randint(0, COMMON["vocab_size"], (MB, COMMON["seq_len"]), generator=g)
        labels = torch.randint(0, COMMON["vocab_size"], (MB, COMMON["seq_len"]), generator=g)
        labels[1, : 3 + m] = -100  # a prompt
        out.append((ids, labels))
    return out


def _scale(case, micro):
    if not CASES[case][2]:
        return None
    return 1 * GA / sum(int((mb[1] != -100).sum()) for mb in micro)


def _train(case, cfg, engine, pipelined, groups):
    """(losses, first step's gradients by name, weights after the last, validation loss, mean balance loss)."""
    import torch

    from rayspeed.train.evaluation import Validator

    auxes = []
    if not pipelined:  # the unsplit model's balance loss of each training forward
        engine.module.register_forward_hook(
            lambda m, args, out: auxes.append(float(m.aux_loss)) if m.training else None)
    steps = [(micro, _scale(case, micro)) for micro in (_micro_batches(s) for s in range(STEPS))]
    losses, grads, weights = train_steps(cfg, engine, pipelined, groups, steps)
    if pipelined:
        fn = engine.module.loss_fn
        aux = float(fn.aux_sum) / fn.aux_forwards if fn.aux_forwards else None
    else:
        aux = sum(auxes) / len(auxes)
    whole = [tuple(torch.cat(parts) for parts in zip(*_micro_batches(99)))]
    val = Validator(cfg, whole, torch.device("cpu"), pipelined, lambda t: float(t), weighted=CASES[case][2])
    return losses, grads, weights, val.run(engine), aux


def _world(rank, world_size):
    import torch

    from rayspeed.engine.build import build_engine
    from rayspeed.engine.deepspeed_config import deepspeed_config
    from rayspeed.parallel.groups import ParallelGroups

    _init_deepspeed()
    solo_groups = SoloGroups()
    out = {}
    for case in CASES:
        torch.manual_seed(0)
        cfg = _cfg(case, 1)
        solo, _ = build_engine(cfg, deepspeed_config(cfg), solo_groups, torch.device("cpu"))
        want = _train(case, cfg, solo, False, solo_groups)
        cfg = _cfg(case, 2)
        groups = ParallelGroups(1, 1, 2)
        engine, pipelined = build_engine(cfg, deepspeed_config(cfg), groups, torch.device("cpu"))
        got = _train(case, cfg, engine, pipelined, groups)
        out[case] = {
            "where": (groups.pp_rank, pipelined),
            "losses": (got[0], want[0]),
            "grads": {n: (float((g - want[1][n]).abs().max()), float(want[1][n].abs().max()))
                      for n, g in got[1].items()},
            "weights": {n: float((w - want[2][n]).abs().max()) for n, w in got[2].items()},
            "val": (got[3], want[3]),
            "aux": (got[4], want[4]),
        }
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_world, 2, timeout_s=300)


@pytest.mark.parametrize("case", CASES)
def test_a_pp2_mixture_of_experts_trains_like_one_unsplit_rank(results, case):
    for rank in results:
        res = rank[case]
        assert res["where"][1]
        got, want = res["losses"]
        assert got == pytest.approx(want, **TOL)
        got, want = res["val"]
        assert got == pytest.approx(want, **TOL)
        assert res["weights"] and max(res["weights"].values()) <= 1e-5, res["weights"]
        # Adam's update ignores a constant gradient scale: only the gradients themselves catch a halved loss
        for name, (diff, scale) in res["grads"].items():
            assert diff <= TOL["abs"] + TOL["rel"] * scale, (case, name, diff, scale)
    last = next(r[case] for r in results if r[case]["where"][0] == 1)
    got, want = last["aux"]
    assert want > 0 and got == pytest.approx(want, **TOL)  # moe/aux_loss: pooled over both stages' layers
    # every parameter's gradient was compared on the stage that holds it
    routers = [n for r in results for n, (_, scale) in r[case]["grads"].items() if n.endswith("router.weight")]
    model = CASES[case][0]
    moe_layers = model.get("moe_layers", range(model["num_layers"]))
    assert len(routers) == len(moe_layers) and all(r[case]["grads"] for r in results)
    assert {n for r in results for n in r[case]["grads"]} == set(results[0][case]["weights"]) | set(
        results[1][case]["weights"])


def test_what_the_pipeline_does_not_take_with_experts_is_refused_naming_the_key():
    """pp and cp with experts parse; ep with pp, tp with pp, cp with pp and ep with cp are one message each naming
    the key and the fix."""
    from rayspeed.config import parse
    from rayspeed.errors import ConfigError

    case = next(iter(CASES))
    base = {"name": "moe-pp", "model": {**COMMON, **CASES[case][0]}, "cluster": {"num_workers": 4},
            "train": {"global_batch_size": 8}}
    cfg = parse({**base, "parallel": dict(dp=2, tp=1, pp=2, ep=1, zero_stage=1, micro_batch_size=1)})
    assert cfg.parallel.pp == 2
    cfg = parse({**base, "model": {**base["model"], "seq_len": 32},
                 "parallel": dict(dp=2, tp=1, pp=1, cp=2, ep=1, zero_stage=1, micro_batch_size=1)})
    assert cfg.parallel.cp == 2
    for parallel, key in ((dict(dp=2, pp=2, ep=2, zero_stage=1), "parallel.ep: 2 with parallel.pp: 2"),
                          (dict(dp=1, tp=2, pp=2, ep=1, zero_stage=1), "parallel.pp: 2 with parallel.tp: 2"),
                          (dict(dp=1, pp=2, cp=2, ep=1, zero_stage=1), "parallel.cp: 2 with parallel.pp: 2"),
                          (dict(dp=2, pp=1, cp=2, ep=2, zero_stage=1), "parallel.ep: 2 with parallel.cp: 2")):
        with pytest.raises(ConfigError) as refused:
            parse({**base, "model": {**base["model"], "seq_len": 32},
                   "parallel": dict({"tp": 1, "micro_batch_size": 1}, **parallel)})
        assert key in str(refused.value) and "; set parallel." in str(refused.value), str(refused.value)
