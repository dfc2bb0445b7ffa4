"""Context parallelism under the pipeline engine (4 gloo ranks, fp32): a cp2 x pp2 engine, built by rayspeed's engine
builder (cp folded into DeepSpeed's pipeline grid's data axis), trains exactly as one unsplit rank on the same
sequences, stepped by rayspeed's TrainStep: the loss of every step, every gradient of the first step and the weights
after the last equal the unsplit engine's at rtol = atol = 1e-5, with two micro-batches per step; so does the
validation loss. Two cases: ulysses at ZeRO-0 with the plain mean over a prompt-masked batch (the divisor counts the
labels of both parts), and ring at ZeRO-1 with packed documents (their ids travel between the stages) under the
token-weighted loss scale."""

from __future__ import annotations

import pytest

from _deepspeed_world import SoloGroups, _init_deepspeed, train_steps
from _dist import run_distributed

TOL = dict(rel=1e-5, abs=1e-5)
MODEL = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64, vocab_size=256,
             seq_len=32, tie_embeddings=False)
STEPS, MB, GA = 2, 2, 2
LR = 3e-5  # small: Adam's steps stay comparable at 1e-5 after the first (its gradients are compared directly)
CASES = {"ulysses-zero0-mean": ("ulysses", 0, False), "ring-zero1-documents-weighted": ("ring", 1, True)}


def _cfg(case, cp, pp):
    from rayspeed.config import parse

    scheme, zero, _ = CASES[case]
    return parse({
        "name": "cp-pp", "model": MODEL,
        "train": {"global_batch_size": MB * GA, "precision": "fp32", "max_steps": 10, "warmup_steps": 0, "lr": LR,
                  "grad_clip": 0.0},
        "parallel": dict(dp=1, tp=1, pp=pp, cp=cp, cp_scheme=scheme, zero_stage=zero, micro_batch_size=MB,
                         grad_accum=GA, sequence_parallel=False, activation_checkpointing="none"),
        "health": {"watchdog": "off"},
        "cluster": {"num_workers": cp * pp},
    })


def _micro_batches(case, step):
    """The step's micro-batches (ids, labels[, document ids]) of whole sequences, as the loader hands them."""
    import torch

    documents = CASES[case][2]
    out = []
    for m in range(GA):
        g = torch.Generator().manual_seed(100 * step + m)
        ids = torch.randint(0, 256, (MB, MODEL["seq_len"]), generator=g)
        labels = torch.randint(0, 256, (MB, MODEL["seq_len"]), generator=g)
        labels[1, : 5 + m] = -100  # a prompt
        if documents:
            seg = torch.tensor([[0] * 11 + [1] * 13 + [2] * 8, [0] * (3 + m) + [1] * (29 - m)])
            out.append((ids, labels, seg))
        else:
            out.append((ids, labels))
    return out


def _scale(case, micro):
    """rayspeed.train.objective.label_scale of a weighted step: dp * grad_accum / the step's counted labels (None:
    the plain mean)."""
    if not CASES[case][2]:
        return None
    return 1 * GA / sum(int((mb[1] != -100).sum()) for mb in micro)


def _train(case, cfg, engine, pipelined, groups):
    """(losses of each step, first step's reduced gradients by name, weights after the last, validation loss)."""
    import torch

    from rayspeed.train.evaluation import Validator

    steps = [(micro, _scale(case, micro)) for micro in (_micro_batches(case, s) for s in range(STEPS))]
    losses, grads, weights = train_steps(cfg, engine, pipelined, groups, steps)
    whole = [tuple(torch.cat(parts) for parts in zip(*_micro_batches(case, 99)))]  # this rank's share: MB x GA rows
    val = Validator(cfg, whole, torch.device("cpu"), pipelined, lambda t: float(t),
                    weighted=CASES[case][2], cp=getattr(groups, "cp", None))
    return losses, grads, weights, val.run(engine)


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
        cfg = _cfg(case, 1, 1)
        solo, _ = build_engine(cfg, deepspeed_config(cfg), solo_groups, torch.device("cpu"))
        want = _train(case, cfg, solo, False, solo_groups)
        cfg = _cfg(case, 2, 2)
        groups = ParallelGroups(1, 1, 2, cp=2, cp_scheme=cfg.parallel.cp_scheme)
        engine, pipelined = build_engine(cfg, deepspeed_config(cfg), groups, torch.device("cpu"))
        got = _train(case, cfg, engine, pipelined, groups)
        out[case] = {
            "where": (groups.pp_rank, groups.cp_rank, pipelined, engine.dp_world_size),
            "losses": (got[0], want[0]),
            "grads": {n: (float((g - want[1][n]).abs().max()), float(want[1][n].abs().max()))
                      for n, g in got[1].items()},
            "weights": {n: float((w - want[2][n]).abs().max()) for n, w in got[2].items()},
            "val": (got[3], want[3]),
        }
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_world, 4, timeout_s=300)


def test_the_ranks_are_two_stages_of_two_sequence_parts(results):
    assert sorted(r[next(iter(CASES))]["where"] for r in results) == [
        (0, 0, True, 2), (0, 1, True, 2), (1, 0, True, 2), (1, 1, True, 2)]  # the grid's data axis is dp x cp


@pytest.mark.parametrize("case", CASES)
def test_a_cp2_x_pp2_engine_trains_like_one_unsplit_rank(results, case):
    for rank in results:
        res = rank[case]
        got, want = res["losses"]
        assert got == pytest.approx(want, **TOL)
        got, want = res["val"]
        assert got == pytest.approx(want, **TOL)
        assert res["weights"] and max(res["weights"].values()) <= 1e-5, res["weights"]
        # Adam's update ignores a constant gradient scale: only the gradients themselves catch a halved loss
        assert res["grads"] and all(scale > 0 for _, scale in res["grads"].values())
        for name, (diff, scale) in res["grads"].items():
            assert diff <= TOL["abs"] + TOL["rel"] * scale, (case, name, diff, scale)
    # every parameter's gradient was compared on the stage that holds it
    assert {n for r in results for n in r[case]["grads"]} == set(results[0][case]["weights"]) | set(
        results[2][case]["weights"])
