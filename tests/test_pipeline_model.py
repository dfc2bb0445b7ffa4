"""The Transformer as a DeepSpeed PipelineModule: same init, same losses as the single-process model."""

from __future__ import annotations

import importlib
import logging
from types import SimpleNamespace

import pytest
import torch

from _dist import run_distributed

CFG = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
           vocab_size=64, seq_len=8)
SEED = 3
MICRO_BATCH, GRAD_ACCUM, STEPS, LR = 2, 2, 3, 1e-2


def _micro_batches():
    gen = torch.Generator().manual_seed(21)
    n = STEPS * GRAD_ACCUM
    ids = torch.randint(0, CFG["vocab_size"], (n, MICRO_BATCH, CFG["seq_len"]), generator=gen)
    labels = torch.randint(0, CFG["vocab_size"], (n, MICRO_BATCH, CFG["seq_len"]), generator=gen)
    return [(ids[i], labels[i]) for i in range(n)]


def _optimizer(params, lr=LR):
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def _reference_losses(tie_embeddings, lr=LR):
    """The same training run on one process, with plain PyTorch."""
    from rayspeed.model import Transformer

    model = Transformer(SimpleNamespace(**CFG, tie_embeddings=tie_embeddings), seed=SEED)
    opt = _optimizer(model.parameters(), lr)
    data = _micro_batches()
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for ids, labels in data[step * GRAD_ACCUM:(step + 1) * GRAD_ACCUM]:
            loss = model(ids, labels) / GRAD_ACCUM
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return model, losses


def _train_pipeline(rank, world_size, tie_options):
    import deepspeed

    from rayspeed.model import Transformer
    from rayspeed.model.pipeline import build_pipeline_module, canonical_named_parameters
    from rayspeed.parallel.groups import ParallelGroups

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # On the CPU accelerator DeepSpeed JIT-compiles a shared-memory all-reduce op (only used
    # for inference) when its comm backend starts; skip it so the test needs no compiler.
    # (import_module: the package attribute `deepspeed.comm.torch` is the torch module itself)
    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
    if hasattr(ds_comm_torch, "build_shm_op"):
        ds_comm_torch.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    groups = ParallelGroups(dp=1, tp=1, pp=2)

    results = {}
    for tie_embeddings in tie_options:  # one world for both: process start-up is the slow part
        cfg = SimpleNamespace(**CFG, tie_embeddings=tie_embeddings)
        module = build_pipeline_module(cfg, groups, num_stages=2, seed=SEED, partition_method="type:Block")

        # Same weights as the non-pipelined model, name for name.
        reference = dict(Transformer(cfg, seed=SEED).named_parameters())
        names = []
        for name, p in canonical_named_parameters(module):
            assert torch.equal(p.detach(), reference[name].detach()), name
            names.append(name)

        config = {
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_accumulation_steps": GRAD_ACCUM,
            "zero_optimization": {"stage": 1},
            "steps_per_print": 10**9,
        }
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=_optimizer(module.parameters()), config=config)
        data = iter(_micro_batches())
        losses = [engine.train_batch(data_iter=data).item() for _ in range(STEPS)]
        results[tie_embeddings] = {"stage": groups.pp_rank, "names": names, "losses": losses}
    return results


def test_two_stage_pipeline_matches_single_process():
    ties = (True, False)
    per_rank = run_distributed(_train_pipeline, 2, ties, timeout_s=120)
    for tie_embeddings in ties:
        _, expected = _reference_losses(tie_embeddings)
        first, last = sorted((r[tie_embeddings] for r in per_rank), key=lambda r: r["stage"])
        assert "embed.weight" in first["names"] and "layers.0.attn.wq.weight" in first["names"]
        assert "layers.1.attn.wq.weight" not in first["names"]
        assert "norm.weight" in last["names"] and "layers.1.mlp.w_down.weight" in last["names"]
        assert ("embed.weight" in last["names"]) == tie_embeddings
        assert ("head.weight" in last["names"]) != tie_embeddings
        # The updates move the later losses well beyond the tolerance, so steps 2-3 check the gradients.
        _, frozen = _reference_losses(tie_embeddings, lr=0.0)
        assert frozen[1:] != pytest.approx(expected[1:], rel=1e-3)
        for result in (first, last):
            assert result["losses"] == pytest.approx(expected, rel=1e-4), (tie_embeddings, result["losses"], expected)


@pytest.mark.parametrize("dp,tp,pp", [(2, 2, 1), (1, 2, 2), (2, 1, 3), (3, 2, 2)])
def test_rank_layout_matches_deepspeed_topology(dp, tp, pp):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from rayspeed.parallel.groups import coords_of, layout, rank_of

    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    groups = layout(dp=dp, tp=tp, pp=pp)
    assert sorted(groups["tp"]) == sorted(topo.get_axis_comm_lists("model"))
    assert sorted(groups["dp"]) == sorted(topo.get_axis_comm_lists("data"))
    assert sorted(groups["pp"]) == sorted(topo.get_axis_comm_lists("pipe"))
    for rank in range(dp * tp * pp):
        c = topo.get_coord(rank)
        assert coords_of(rank, dp, tp) == (c.pipe, c.data, c.model)
        assert rank_of(c.pipe, c.data, c.model, dp, tp) == rank
