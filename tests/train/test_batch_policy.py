"""The playbook batch policy after losing workers: the batch never grows, is a multiple of dp x micro-batch,
and the learning rate follows it by the square-root rule."""

import math

import pytest

from rayspeed.config.load import parse
from rayspeed.train.batch_policy import apply_batch_policy, new_global_batch


def _job(world, tp, pp, batch, micro="auto", lr=3e-4, policy="playbook"):
    return parse({
        "name": "bp",
        "model": {"hidden_size": 64, "num_layers": 8, "num_heads": 8, "num_kv_heads": 8, "vocab_size": 256},
        "train": {"global_batch_size": batch, "lr": lr, "min_lr": 3e-5},
        "parallel": {"tp": tp, "pp": pp, "micro_batch_size": micro},
        "cluster": {"num_workers": [1, world], "use_gpu": True, "gpu": "h100-sxm-80gb", "gpus_per_node": 8},
        "resilience": {"batch_policy": policy},
    })


# (old world, new world, tp, pp, global batch, micro-batch) -> expected new global batch
TABLE = [
    (64, 48, 4, 1, 16, "auto", 12),   # dp 12: 16 x 0.75^0.8 = 12.7 -> 12 (the old rule gave 48: lr x1.73)
    (16, 12, 2, 1, 8, "auto", 6),     # dp 6: 8 x 0.75^0.8 = 6.4 -> 6 (the old rule grew it to 12)
    (64, 32, 1, 1, 1024, 4, 512),     # dp 32 x mb 4 = 128: 1024 x 0.5^0.8 = 588 -> 512
    (8, 7, 1, 1, 64, 2, 56),          # dp 7 x mb 2 = 14: 64 x (7/8)^0.8 = 57.0 -> 56
    (32, 24, 2, 2, 96, 1, 72),        # dp 6: 96 x 0.75^0.8 = 76.3 -> 72
    (16, 8, 1, 1, 16, 4, 8),          # dp 8 x mb 4 = 32 > 9.2: micro-batch re-planned to 1 -> 8
    (16, 16, 2, 1, 16, "auto", 16),   # nothing lost: kept
]


@pytest.mark.parametrize("old,new,tp,pp,batch,micro,expected", TABLE)
def test_playbook_batch_rounds_down_and_never_grows(old, new, tp, pp, batch, micro, expected):
    job, line = apply_batch_policy(_job(old, tp, pp, batch, micro), new)
    g = job.train.global_batch_size
    assert g == expected, line
    assert g <= batch
    dp = new // (tp * pp)
    mb = job.parallel.micro_batch_size
    assert g % (dp * (mb if isinstance(mb, int) else 1)) == 0, line
    # the learning rate follows the batch by the square-root rule, and never grows when the batch shrinks
    assert job.train.lr == pytest.approx(3e-4 * math.sqrt(g / batch))
    assert job.train.min_lr == pytest.approx(3e-5 * math.sqrt(g / batch))
    assert job.train.lr <= 3e-4


def test_keep_global_and_auto_lr_are_left_alone():
    job, line = apply_batch_policy(_job(64, 4, 1, 16, policy="keep_global"), 48)
    assert job.train.global_batch_size == 16 and job.train.lr == 3e-4 and "kept" in line
    job, _ = apply_batch_policy(_job(64, 4, 1, 16, lr="auto"), 48)
    assert job.train.global_batch_size == 12 and job.train.lr == "auto"


def test_tp_and_pp_come_from_the_planner_when_auto():
    job, line = apply_batch_policy(_job(16, "auto", "auto", 64), 12)
    assert job.train.global_batch_size <= 64 and "rounded down" in line


def test_new_global_batch_replans_the_micro_batch_only_when_it_was_fixed():
    assert new_global_batch(16, 16, 8, 8, 4) == (8, 1)
    assert new_global_batch(16, 16, 8, 8, None) == (8, None)
    assert new_global_batch(100, 10, 9, 9, 2) == (90, 2)
