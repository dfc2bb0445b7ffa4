"""A step that runs out of memory (rayspeed.train.oom): what counts as one, what is recorded, when to give up."""

import json

import pytest
import torch

from rayspeed.config.chaos_keys import ChaosConfig, OomAt
from rayspeed.train import oom
from rayspeed.train.chaos import ChaosDrills


def test_what_counts_as_running_out_of_device_memory():
    assert oom.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert oom.is_out_of_memory(RuntimeError("CUDA error: out of memory\nCUDA kernel errors ... CUDA out of memory"))
    assert oom.is_out_of_memory(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)"))
    assert not oom.is_out_of_memory(RuntimeError("Connection closed by peer"))
    assert not oom.is_out_of_memory(MemoryError())  # the host's: the doctor names it, nothing is re-planned
    assert oom.tried_bytes("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has") == int(2.5 * 2**30)
    assert oom.tried_bytes("Tried to allocate 20.00 MiB") == 20 << 20
    assert oom.tried_bytes("no size here") == 0


def _layout(mb: int) -> dict:
    return {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 2, "micro_batch_size": mb, "grad_accum": 8 // mb, "cp": 1,
            "ep": 1, "activation_checkpointing": "none", "sequence_parallel": False}


def test_records_are_this_submission_s_one_per_layout_and_the_budget_ends_the_job(tmp_path):
    log = tmp_path / oom.OOM_LOG
    log.parent.mkdir(parents=True)
    rows = [{"launched_at": 1.0, "layout": _layout(8), "step": 3, "rank": 0, "need_bytes": 0},
            {"launched_at": 1.0, "layout": _layout(8), "step": 3, "rank": 1, "need_bytes": 0},  # same attempt
            {"launched_at": 1.0, "layout": _layout(4), "step": 3, "rank": 0, "need_bytes": 3 << 30},
            {"launched_at": 0.5, "layout": _layout(2), "step": 9, "rank": 0, "need_bytes": 0}]  # an earlier one
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = oom.submission_records(str(tmp_path), 1.0)
    assert [r["layout"]["micro_batch_size"] for r in records] == [8, 4]
    assert oom.give_up_reason(records, 2) is None
    reason = oom.give_up_reason(records, 1)
    assert reason.startswith("out of memory on every layout tried, 2 layouts after 1 re-plans")
    assert "micro-batch 8 x 1 (out of memory at step 3 on rank 0; need not measured" in reason
    assert "micro-batch 4 x 2 (out of memory at step 3 on rank 0; needed at least 3.00 GiB" in reason


@pytest.mark.parametrize("attempts, raises", [(1, [True, False]), ("all", [True, True])])
def test_the_drill_raises_cuda_s_error_once_or_in_every_attempt(tmp_path, attempts, raises):
    cfg = ChaosConfig(oom_at_step=OomAt(rank=0, step=3, attempts=attempts))
    seen = []
    for _attempt in range(2):
        drills = ChaosDrills(cfg, 0, str(tmp_path))
        drills.at_step(2)  # another step: nothing
        try:
            drills.at_step(3)
            seen.append(False)
        except torch.OutOfMemoryError as e:
            assert oom.is_out_of_memory(e) and oom.tried_bytes(str(e)) == 20 << 20
            seen.append(True)
    assert seen == raises
    ChaosDrills(cfg, 1, str(tmp_path)).at_step(3)  # another rank: nothing
