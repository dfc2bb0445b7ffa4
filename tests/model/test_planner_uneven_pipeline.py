"""Uneven pipeline stages, end to end on CPU: the planner's split is what the runtime builds, the pipeline engine's
losses equal the single-process model's (3 layers on pp 2, both ways round, tied and untied), and a checkpoint
written with an uneven split converts to a universal checkpoint (DeepSpeed ds_to_universal, as on an elastic
resize) that loads into another split and continues the same trajectory."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from _dist import run_distributed
from rayspeed.compat import skip_deepspeed_shm_comm_op

CFG = dict(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=64, vocab_size=64, seq_len=8)
SEED = 5
MICRO_BATCH, GRAD_ACCUM, STEPS, MORE, LR = 2, 2, 3, 2, 1e-2


def _micro_batches(steps):
    gen = torch.Generator().manual_seed(33)
    n = steps * GRAD_ACCUM
    ids = torch.randint(0, CFG["vocab_size"], (n, MICRO_BATCH, CFG["seq_len"]), generator=gen)
    labels = torch.randint(0, CFG["vocab_size"], (n, MICRO_BATCH, CFG["seq_len"]), generator=gen)
    return [(ids[i], labels[i]) for i in range(n)]


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def _reference_losses(tie_embeddings, steps):
    from rayspeed.model import Transformer

    model = Transformer(SimpleNamespace(**CFG, tie_embeddings=tie_embeddings), seed=SEED)
    opt = _optimizer(model.parameters())
    data = _micro_batches(steps)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for ids, labels in data[step * GRAD_ACCUM:(step + 1) * GRAD_ACCUM]:
            loss = model(ids, labels) / GRAD_ACCUM
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses


def _ds_config(universal=False):
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": GRAD_ACCUM,
            "zero_optimization": {"stage": 1}, "steps_per_print": 10**9,
            "checkpoint": {"load_universal": universal}}


def _init_deepspeed():
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    skip_deepspeed_shm_comm_op()  # no C++ build of DeepSpeed's inference all-reduce on CPU
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def _build(cfg, split, groups):
    from rayspeed.engine.pipeline_module import build_pipeline_module

    return build_pipeline_module(cfg, groups, num_stages=2, seed=SEED, stage_layers=split)


def _train_uneven(rank, world_size, cases):
    from rayspeed.model.decoder import canonical_named_parameters
    from rayspeed.parallel.groups import ParallelGroups

    deepspeed = _init_deepspeed()
    out = {}
    for name, tie, split in cases:
        groups = ParallelGroups(dp=1, tp=1, pp=2)
        cfg = SimpleNamespace(**CFG, tie_embeddings=tie)
        module = _build(cfg, split, groups)
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=_optimizer(module.parameters()),
                                               config=_ds_config())
        data = iter(_micro_batches(STEPS))
        losses = [engine.train_batch(data_iter=data).item() for _ in range(STEPS)]
        blocks = sorted({n.split(".")[1] for n, _ in canonical_named_parameters(module) if n.startswith("layers.")})
        out[name] = {"stage": groups.pp_rank, "losses": losses, "blocks": blocks, "parts": list(module.parts)}
    return out


CASES = [("2-1_tied", True, (2, 1)), ("1-2_untied", False, (1, 2))]


def test_uneven_split_trains_like_the_single_process_model():
    per_rank = run_distributed(_train_uneven, 2, CASES, timeout_s=90)
    refs = {tie: _reference_losses(tie, STEPS) for tie in (True, False)}
    for name, tie, split in CASES:
        runs = sorted((r[name] for r in per_rank), key=lambda r: r["stage"])
        assert [len(r["blocks"]) for r in runs] == list(split), (name, runs)  # the runtime built the planner's split
        assert runs[0]["parts"] == [0, 1 + split[0], CFG["num_layers"] + 3]
        for run in runs:
            assert run["losses"] == pytest.approx(refs[tie], rel=1e-4), (name, run["losses"], refs[tie])


def _save_convert_resume(rank, world_size, ckpt_dir):
    import torch.distributed as dist

    from rayspeed.checkpoint.resume import convert_to_universal
    from rayspeed.parallel.groups import ParallelGroups

    deepspeed = _init_deepspeed()
    cfg = SimpleNamespace(**CFG, tie_embeddings=True)
    data = _micro_batches(STEPS + MORE)
    module = _build(cfg, (2, 1), ParallelGroups(dp=1, tp=1, pp=2))
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=_optimizer(module.parameters()), config=_ds_config())
    it = iter(data[:STEPS * GRAD_ACCUM])
    first = [engine.train_batch(data_iter=it).item() for _ in range(STEPS)]
    engine.save_checkpoint(ckpt_dir, tag="ds")
    dist.barrier()
    if rank == 0:
        convert_to_universal(ckpt_dir)
    dist.barrier()
    # Another split: blocks move between stages, so only a universal (by-name) checkpoint can load it.
    module2 = _build(cfg, (1, 2), ParallelGroups(dp=1, tp=1, pp=2))
    engine2, _, _, _ = deepspeed.initialize(model=module2, optimizer=_optimizer(module2.parameters()),
                                            config=_ds_config(universal=True))
    engine2.load_checkpoint(ckpt_dir, tag="ds_universal", load_optimizer_states=True, load_lr_scheduler_states=False)
    it2 = iter(data[STEPS * GRAD_ACCUM:])
    more = [engine2.train_batch(data_iter=it2).item() for _ in range(MORE)]
    return {"first": first, "more": more}


def test_uneven_checkpoint_converts_to_universal_and_loads_into_another_split(tmp_path):
    per_rank = run_distributed(_save_convert_resume, 2, str(tmp_path), timeout_s=120)
    assert os.path.exists(tmp_path / "ds_universal" / ".converted")
    ref = _reference_losses(True, STEPS + MORE)
    for r in per_rank:
        assert r["first"] == pytest.approx(ref[:STEPS], rel=1e-4)
        assert r["more"] == pytest.approx(ref[STEPS:], rel=1e-3), (r["more"], ref[STEPS:])
