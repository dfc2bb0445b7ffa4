"""A real DeepSpeed engine (ZeRO-2 over 2 gloo ranks): the files an async save writes from its host snapshot are
byte for byte those of a synchronous save of the same state, even though training went on after the snapshot, and
they load back into exactly that state."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from _deepspeed_world import _batch, _init_deepspeed, job_cfg
from _dist import run_distributed


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _step(engine, seed):
    x, y = _batch(seed)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()


def _sync_then_async(rank, world_size, root):
    import torch.distributed as dist

    from rayspeed import compat
    from rayspeed.checkpoint.host_copy import HostCopy
    from rayspeed.engine.build import build_engine
    from rayspeed.engine.deepspeed_config import deepspeed_config
    from rayspeed.parallel.groups import ParallelGroups

    _init_deepspeed()
    cfg = job_cfg(dp=2, zero=2)
    engine, _ = build_engine(cfg, deepspeed_config(cfg), ParallelGroups(2, 1, 1), torch.device("cpu"))
    for s in range(2):
        _step(engine, 10 * rank + s)
    root = Path(root)
    client = {"step": 2, "data": {"consumed_samples": 8}}
    engine.save_checkpoint(str(root / "sync"), tag="ds", client_state=client, save_latest=False)
    assert compat.async_checkpoint_problem(engine) is None
    host = HostCopy()
    host.begin()
    with compat.capture_checkpoint_writes(engine, host.copy) as captured:
        engine.save_checkpoint(str(root / "async"), tag="ds", client_state=client, save_latest=False)
    host.end()
    captured = list(captured)
    snapshot_params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    _step(engine, 100 + rank)  # training goes on before the background write
    moved = any(not torch.equal(v, snapshot_params[k]) for k, v in engine.module.state_dict().items())
    write = compat.checkpoint_writer(engine)
    for path, state in captured:  # what the background thread does
        write(state, path)
    dist.barrier()
    out = {"captured": sorted(os.path.relpath(p, root / "async") for p, _ in captured), "moved": moved}
    if rank == 0:
        out["sync"], out["async"] = _hashes(root / "sync"), _hashes(root / "async")
    engine.load_checkpoint(str(root / "async"), tag="ds")
    out["restored"] = all(torch.equal(v, snapshot_params[k]) for k, v in engine.module.state_dict().items())
    return out


def test_async_snapshot_writes_what_a_sync_save_writes(tmp_path):
    r0, r1 = run_distributed(_sync_then_async, 2, str(tmp_path), timeout_s=240)
    assert r0["moved"] and r1["moved"]  # the live state changed after the snapshot
    assert r0["sync"] == r0["async"], (r0["sync"], r0["async"])  # same files, same bytes
    assert {"ds/mp_rank_00_model_states.pt", "ds/zero_pp_rank_0_mp_rank_00_optim_states.pt"} <= set(r0["captured"])
    assert r1["captured"] == ["ds/zero_pp_rank_1_mp_rank_00_optim_states.pt"]  # each rank captures its own files
    assert r0["restored"] and r1["restored"]
