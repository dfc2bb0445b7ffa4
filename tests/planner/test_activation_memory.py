"""The planner's activation memory against what one block of the model really keeps for backward (CPU, tp = 1).

scripts/saved_activations.py counts the bytes of the distinct non-parameter storages autograd saves during one
block's forward (saved_tensors_hooks): without recomputation (the whole block, and its attention and MLP
sub-blocks against layer_saved's terms), and under selective / full recomputation (activation_bytes' kept term).

Tolerance: 1% of the prediction. The count is deterministic (bytes of storages, no timing, no allocator), so the
tolerance only covers what a formula may fairly leave out: the fp32 rsqrt of each norm row (4 bytes per token
per norm, at most 0.3% of any part measured here). The smallest tensor that matters, one h wide, is at least 2.8%
of a block and 8% of a sub-block here, so a formula that drops it fails (the log-sum-exp, a few elements per
token, is below what any tolerance can see). The first measurement found the formula off by -11% to +47% without
recomputation (the SDPA output counted twice, k/v not expanded for GQA, fp32 norms, RoPE tables and Qwen3's q/k norms
not counted): layer_saved now counts what autograd saves, and every case matches.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOL = 0.01


def _load():
    spec = importlib.util.spec_from_file_location("saved_activations", ROOT / "scripts" / "saved_activations.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


sa = _load()

def _params():
    out = []
    for i, (model, _) in enumerate(sa.CASES):
        for precision in sa.DTYPES:
            for mode, part in [("none", p) for p in sa.PARTS] + [("selective", "block"), ("full", "block")]:
                out.append(pytest.param(i, precision, mode, part, id=f"case{i}-{precision}-{mode}-{part}"))
    return out


@functools.lru_cache(maxsize=None)
def line(i: int, precision: str, mode: str, part: str) -> dict:
    model, micro_batch = sa.CASES[i]
    return sa.compare(model, micro_batch, mode, precision, part)


@pytest.mark.parametrize("i,precision,mode,part", _params())
def test_planner_matches_the_measured_saved_activations(i, precision, mode, part):
    got = line(i, precision, mode, part)
    assert got["measured"] == pytest.approx(got["predicted_bytes_per_token_per_block"], rel=TOL), got


def test_recomputation_really_saves_less():
    """The measurement sees the checkpoints: full < selective < none, and full keeps exactly the block's input."""
    model = sa.CASES[0][0]
    by_mode = {m: line(0, "bf16", m, "block")["measured"] for m in ("none", "selective", "full")}
    assert by_mode["full"] < by_mode["selective"] < by_mode["none"]
    assert by_mode["full"] == model["hidden_size"] * 2  # bf16 [b, s, h] per token


@pytest.mark.parametrize("pp", [2, 3, 4, 8, 16])
def test_in_flight_micro_batches_are_deepspeeds_1f1b(pp):
    """The planner's micro-batches in flight per stage against DeepSpeed 0.19.8's own TrainSchedule (what the
    pipeline engine runs): the most forwards any point of the schedule has done without their backward, and the
    engine's pipe buffers (one per in-flight micro-batch, at least two). scripts/bench_pipeline_memory.py measures
    the memory that follows from it."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule

    from rayspeed.config.layout import Layout
    from rayspeed.planner.memory import micro_batches_in_flight

    for m in range(1, 2 * pp + 2):
        lay = Layout(dp=1, tp=1, pp=pp, zero_stage=1, micro_batch_size=1, grad_accum=m)
        for stage in range(pp):
            schedule = TrainSchedule(micro_batches=m, stages=pp, stage_id=stage)
            alive = most = 0
            for step in schedule.steps():
                for cmd in step:
                    alive += isinstance(cmd, ForwardPass) - isinstance(cmd, BackwardPass)
                    most = max(most, alive)
            assert alive == 0
            assert micro_batches_in_flight(lay, stage) == most, (pp, m, stage)
            assert schedule.num_pipe_buffers() == max(2, most), (pp, m, stage)
