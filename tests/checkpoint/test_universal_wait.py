"""A universal-checkpoint conversion longer than the process-group timeout: rank 0 converts (DeepSpeed's
ds_to_universal, real), the other rank waits on the conversion's done-marker outside any collective, so neither
times out. Before, the waiting rank sat in an all-gather under the group's timeout and the group was torn down
half-way; every restart then converted again until the restarts ran out."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from _cluster import ROOT, run_job
from _dist import run_distributed

GROUP_TIMEOUT_S = 3.0  # far shorter than the conversion (a subprocess that imports DeepSpeed alone takes longer)


def _resume_at_dp2(rank, world_size, exp_dir, ckpt):
    import torch.distributed as dist

    from rayspeed.checkpoint import manifest
    from rayspeed.checkpoint.manager import CheckpointManager
    from rayspeed.config.load import load
    from rayspeed.engine.deepspeed_config import deepspeed_config
    from rayspeed.planner import resolve

    cfg, _ = resolve(load(str(ROOT / "configs" / "tiny-cpu.yaml"), ["parallel.zero_stage=2", "cluster.num_workers=2"]),
                     world_size=2)
    ctx = SimpleNamespace(rank=rank, world_size=world_size, local_rank=rank, node_id="node", experiment_dir=exp_dir,
                          under_ray=False, is_rank0=rank == 0)
    mgr = CheckpointManager(cfg, ctx, chosen=ckpt, meta=manifest.read_manifest(ckpt))
    t0 = time.monotonic()
    ds = mgr.prepare(deepspeed_config(cfg))
    waited = time.monotonic() - t0
    dist.barrier()  # the group is alive: nobody timed out
    return {"universal": ds.get("checkpoint", {}).get("load_universal"), "seconds": waited}


@pytest.mark.ray
def test_conversion_longer_than_the_group_timeout_completes(tmp_path):
    r, summary = run_job(tmp_path, ["--config", str(ROOT / "configs" / "tiny-cpu.yaml"), "--launcher", "local",
                                    "--set", "name=conv", "--set", "parallel.zero_stage=2", "--set",
                                    "train.max_steps=2", "--set", "resilience.checkpoint_every_steps=2", "--set",
                                    "tracking.loss_landscape=false", "--set", "health.preflight=false"], None)
    assert r.returncode == 0, r.stderr[-3000:]
    exp = tmp_path / "runs" / "conv"
    ckpt = str(exp / "checkpoint_step00000002")
    results = run_distributed(_resume_at_dp2, 2, str(exp), ckpt, timeout_s=GROUP_TIMEOUT_S, deadline_s=600)
    assert all(res["universal"] for res in results)
    assert results[1]["seconds"] > GROUP_TIMEOUT_S, results  # rank 1 waited longer than any collective may
    assert (Path(ckpt) / "ds_universal" / ".converted").exists()
