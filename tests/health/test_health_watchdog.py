import logging
import math

import pytest

from rayspeed.config.schema import HealthConfig
from rayspeed.health.watchdog import Watchdog


def _warm(wd, norms=(1.0, 1.1, 0.9, 1.0), start=1):
    for i, n in enumerate(norms):
        assert wd.check(start + i, 2.0, n).action == "ok"
    return start + len(norms)


def test_healthy_steps_are_ok_and_quiet(caplog):
    wd = Watchdog("skip", spike_factor=10, window=5)
    with caplog.at_level(logging.INFO, logger="rayspeed.health"):
        _warm(wd)
    assert not caplog.records
    assert wd.baseline() == pytest.approx(1.0)


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_non_finite_loss_skips_under_skip_policy(loss, caplog):
    wd = Watchdog("skip")
    with caplog.at_level(logging.WARNING, logger="rayspeed.health"):
        d = wd.check(7, loss, 1.0)
    assert d.action == "skip" and "loss is" in d.reason and d.step == 7
    assert len(caplog.records) == 1 and "step 7 skip" in caplog.records[0].getMessage()


def test_non_finite_grad_norm_is_bad_too():
    assert Watchdog("rollback").check(3, 2.0, math.nan).action == "rollback"


def test_grad_norm_spike_against_the_window_median():
    wd = Watchdog("skip", spike_factor=10, window=5)
    step = _warm(wd)
    assert wd.check(step, 2.0, 9.0).action == "ok"  # 9x the median: not a spike
    d = wd.check(step + 1, 2.0, 50.0)
    assert d.action == "skip" and "grad-norm spike" in d.reason and "10 x median" in d.reason


def test_no_spike_is_called_before_the_window_has_history():
    wd = Watchdog("skip", spike_factor=10, window=20)
    assert wd.check(1, 5.0, 100.0).action == "ok"  # warm-up norms are large
    assert wd.check(2, 5.0, 3.0).action == "ok"


def test_skipped_steps_do_not_raise_the_baseline():
    wd = Watchdog("skip", spike_factor=10, window=5, max_skips=10)
    step = _warm(wd)
    for i in range(4):
        assert wd.check(step + i, 2.0, 100.0).action == "skip"
    assert wd.baseline() == pytest.approx(1.0)


def test_rollback_policy_rolls_back():
    wd = Watchdog("rollback", spike_factor=5, window=5)
    step = _warm(wd)
    d = wd.check(step, 2.0, 40.0)
    assert d.action == "rollback" and "last verified checkpoint" in d.reason


def test_consecutive_skips_escalate_to_rollback():
    wd = Watchdog("skip", max_skips=2)
    assert [wd.check(s, math.nan, None).action for s in range(1, 5)] == ["skip", "skip", "rollback", "skip"]
    # a good step resets the count
    wd = Watchdog("skip", max_skips=2)
    wd.check(1, math.nan)
    wd.check(2, 2.0, 1.0)
    assert wd.check(3, math.nan).action == "skip"


def test_zero_max_skips_never_escalates():
    wd = Watchdog("skip", max_skips=0)
    assert {wd.check(s, math.nan).action for s in range(20)} == {"skip"}


def test_off_keeps_the_step_but_says_so(caplog):
    wd = Watchdog("off")
    with caplog.at_level(logging.WARNING, logger="rayspeed.health"):
        d = wd.check(4, math.nan, 1.0)
    assert d.action == "ok" and "watchdog is off" in d.reason
    assert len(caplog.records) == 1


def test_reset_and_state_round_trip():
    wd = Watchdog("skip", window=5)
    _warm(wd)
    state = wd.state_dict()
    wd2 = Watchdog("skip", window=5)
    wd2.load_state_dict(state)
    assert wd2.baseline() == wd.baseline()
    wd2.reset()
    assert wd2.baseline() is None


def test_from_config_and_bad_arguments():
    wd = Watchdog.from_config(HealthConfig(watchdog="rollback", grad_norm_spike_factor=4.0, watchdog_window=8))
    assert (wd.policy, wd.spike_factor, wd.window) == ("rollback", 4.0, 8)
    assert Watchdog.from_config(HealthConfig()).policy == "skip"
    with pytest.raises(ValueError):
        Watchdog("sometimes")
    with pytest.raises(ValueError):
        Watchdog("skip", spike_factor=1.0)
