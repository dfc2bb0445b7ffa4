"""An adapter job's checkpoint across an elastic resize (2 gloo ranks, real DeepSpeed): its ZeRO partitions hold the
adapter and the norms trained in full only (DeepSpeed's exclude_frozen_parameters), DeepSpeed's ds_to_universal
converts them, and a world of another data-parallel size loads the universal checkpoint and continues the
uninterrupted run's losses: ZeRO-2 shrinks dp2 -> dp1 (each rank a dp1 world of its own, grad_accum 2 for the same
global batch) and grows back to dp2; ZeRO-3 (the frozen base still partitioned) shrinks. The job's own path to this
(the manifest's layout differs, rank 0 converts, the others wait on its marker) is the full fine-tune's, tested in
tests/checkpoint and the node drill; what is an adapter's own is what the checkpoint holds and how it loads back."""

from __future__ import annotations

from pathlib import Path

import pytest

from _deepspeed_world import MODEL, SoloGroups, _batch, _init_deepspeed
from _dist import run_distributed

STEPS, MORE, AGAIN = 2, 3, 2


def _cfg(dp, zero):
    from rayspeed.config import parse

    return parse({
        "name": "resize", "model": {**MODEL, "adapter": {"type": "lora", "rank": 4, "trainable": ["norms"]}},
        "train": {"global_batch_size": 4, "precision": "fp32", "max_steps": 10, "warmup_steps": 0, "lr": 1e-2},
        "parallel": dict(dp=dp, tp=1, pp=1, zero_stage=zero, micro_batch_size=2, grad_accum=2 // dp,
                         sequence_parallel=False, activation_checkpointing="none"),
        "cluster": {"num_workers": 2},
    })


def _engine(dp, zero, groups, universal=False):
    import torch

    from rayspeed.engine.build import build_engine
    from rayspeed.engine.deepspeed_config import deepspeed_config
    from rayspeed.engine.deepspeed_state import with_universal_load

    cfg = _cfg(dp, zero)
    ds = deepspeed_config(cfg)
    engine, _ = build_engine(cfg, with_universal_load(ds) if universal else ds, groups, torch.device("cpu"))
    return engine


def _train(engine, batches):
    """Mean loss of one step over `batches` (one micro-batch each; DeepSpeed steps at the accumulation boundary)."""
    total = 0.0
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        total += loss.item()
    return total / len(batches)


def _dp2_losses(engine, data, rank):
    import torch
    import torch.distributed as dist

    out = []
    for step in data:
        v = torch.tensor(_train(engine, [step[rank]]), dtype=torch.float64)
        dist.all_reduce(v)
        out.append(float(v) / 2)
    return out


def _resizes(rank, world_size, root, zero):
    import torch.distributed as dist

    from rayspeed.checkpoint.resume import convert_to_universal
    from rayspeed.engine.deepspeed_state import DeepSpeedState
    from rayspeed.parallel.groups import ParallelGroups

    _init_deepspeed()
    data = [[_batch(10 * s + r) for r in range(2)] for s in range(STEPS + MORE + AGAIN)]
    head, middle, tail = data[:STEPS], data[STEPS:STEPS + MORE], data[STEPS + MORE:]
    root = Path(root)
    dp2 = _engine(2, zero, ParallelGroups(2, 1, 1))
    _dp2_losses(dp2, head, rank)
    state = DeepSpeedState(dp2)
    state.save(root / "at2", {"step": STEPS})
    saved = {"frozen_excluded": state.frozen}
    dist.barrier()
    if rank == 0:
        convert_to_universal(root / "at2")
    dist.barrier()
    want = {"middle": _dp2_losses(dp2, middle, rank), "tail": _dp2_losses(dp2, tail, rank)}

    dp1 = _engine(1, zero, SoloGroups(), universal=True)  # every rank a world of one: the shrunk job
    client = DeepSpeedState(dp1).load(root / "at2", universal=True)
    got = {"client_step": client["step"], "middle": [_train(dp1, step) for step in middle]}
    if zero == 2:  # grow back: the dp1 checkpoint converted and loaded into a dp2 world
        mine = root / f"at1-{rank}"
        DeepSpeedState(dp1).save(mine, {"step": STEPS + MORE})
        if rank == 0:
            convert_to_universal(mine)
        dist.barrier()
        grown = _engine(2, zero, ParallelGroups(2, 1, 1), universal=True)
        DeepSpeedState(grown).load(root / "at1-0", universal=True)
        got["tail"] = _dp2_losses(grown, tail, rank)
    return {"want": want, "got": got, **saved}


@pytest.mark.parametrize("zero", [2, 3])
def test_an_adapter_checkpoint_crosses_a_resize_through_the_universal_conversion(tmp_path, zero):
    for res in run_distributed(_resizes, 2, str(tmp_path), zero, timeout_s=300):
        assert res["frozen_excluded"] and res["got"]["client_step"] == STEPS
        assert res["got"]["middle"] == pytest.approx(res["want"]["middle"], rel=1e-5, abs=1e-5)
        if zero == 2:
            assert res["got"]["tail"] == pytest.approx(res["want"]["tail"], rel=1e-5, abs=1e-5)
    # What the universal checkpoint holds: the trained parameters (adapters, norms), none of the frozen base's.
    held = sorted(p.name for p in (tmp_path / "at2" / "ds_universal" / "zero").iterdir() if p.is_dir())
    assert held and all(".adapter.lora_" in n or "norm" in n for n in held), held
    assert any(".adapter.lora_A" in n for n in held) and any("norm" in n for n in held)
