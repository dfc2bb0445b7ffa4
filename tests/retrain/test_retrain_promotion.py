"""Safe promotion: the cycle lock holds across hosts on object storage (S3 conditional writes, against moto's real
S3 server; refused where no such lock exists), the champion is re-read before the alias moves, and a champion and
its challenger are compared like with like. The "training job" of a cycle is a stub here (tests/retrain's real
end-to-end cycles are in test_retrain.py): it registers a prepared model in a real MLflow store (SQLite in
tmp_path) and writes the job's summary, and can act as another host that promotes meanwhile."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import _retrain_stub
from _retrain_stub import REG
from _retrain_stub import client as _client
from _retrain_stub import export_random as _export
from _retrain_stub import job_file as _job
from _retrain_stub import register_champion as _champion
from _retrain_stub import stub_command as _stub

ROOT = Path(__file__).resolve().parents[2]
home = _retrain_stub.home  # the fixture

# ---------------------------------------------------------------- the champion is re-read before the alias moves


def test_a_champion_promoted_meanwhile_is_not_overwritten(home):
    from rayspeed.config.load import load
    from rayspeed.retrain.champion import token_file
    from rayspeed.retrain.cycle import run_cycle

    cfg = _job(home)
    model, other = _export(home, cfg, "m"), _export(home, cfg, "other", scale=8.0)
    data_hash = token_file(load(cfg), str(home / "runs")).content_hash
    _champion(home, model, val=5.0, data_hash=data_hash)  # same data: recorded values are compared
    env = {"STUB_MODEL_DIR": model, "STUB_VAL_LOSS": "1.0", "STUB_OTHER_HOST_PROMOTES": other}
    r = run_cycle(cfg, force=True, launcher="local", job_cmd=_stub(home), env=env)
    # Better than the champion it compared with (1.0 < 5.0), but that is not the champion any more.
    assert (r.outcome, r.exit_code, r.version) == ("rejected", 4, "2"), r.reason
    assert "the champion moved from version 1 to 3 while this cycle ran" in r.reason
    c = _client(home)
    assert str(c.get_model_version_by_alias(REG, "champion").version) == "3"  # the other host's promotion stands
    assert c.get_model_version(REG, "2").tags["rayspeed.retrain.decision"] == "rejected"
    # Nobody promoting meanwhile: the same cycle promotes (over version 3, re-evaluated like it: no data hash).
    r = run_cycle(cfg, force=True, launcher="local", job_cmd=_stub(home), env={**env, "STUB_OTHER_HOST_PROMOTES": ""})
    assert (r.outcome, r.exit_code, r.version, r.champion_after) == ("promoted", 0, "4", "4"), r.reason


def test_champion_and_challenger_are_evaluated_the_same_way(home):
    """The challenger's recorded val/loss (training precision) says 0.01; measured like the champion (fp32, CPU,
    the current held-out split) it is far worse, so it is not promoted."""
    from rayspeed.config.load import load
    from rayspeed.retrain.champion import evaluate_model_dir, token_file
    from rayspeed.retrain.cycle import run_cycle

    cfg = _job(home)
    good, bad = _export(home, cfg, "good"), _export(home, cfg, "bad", scale=8.0)
    _champion(home, good, val=5.9, data_hash="older-data")  # trained on other data: both are re-evaluated
    r = run_cycle(cfg, launcher="local", job_cmd=_stub(home), env={"STUB_MODEL_DIR": bad, "STUB_VAL_LOSS": "0.01"})
    job = load(cfg)
    tf = token_file(job, str(home / "runs"))
    assert (r.outcome, r.exit_code, r.version, r.champion_after) == ("rejected", 4, "2", "1"), r.reason
    assert r.val_loss == pytest.approx(evaluate_model_dir(bad, job, tf)) and r.val_loss > 1.0
    assert r.champion_val_loss == pytest.approx(evaluate_model_dir(good, job, tf))
    assert "versions 1 and 2: both re-evaluated on the current held-out split" in r.baseline
    assert str(_client(home).get_model_version_by_alias(REG, "champion").version) == "1"


# ---------------------------------------------------------------- a lock every host sees


def test_storage_without_a_shared_lock_is_refused(home):
    from rayspeed.retrain.cycle import run_cycle

    r = run_cycle(_job(home), ["storage.path=gs://some-bucket/runs"], launcher="local",
                  job_cmd=[sys.executable, "-c", "raise SystemExit(0)"])
    assert (r.outcome, r.exit_code) == ("bad_input", 2), r.reason
    assert "retraining needs a lock that every host sharing this storage sees" in r.reason


def _lock_uri(bucket: str) -> str:
    return f"s3://{bucket}/runs/.retrain/rt.lock"


def test_s3_lock_one_holder_at_a_time(s3):
    from rayspeed.retrain.lock import Locked, S3Lock

    uri = _lock_uri(s3.bucket())
    first = S3Lock(uri).acquire()
    with pytest.raises(Locked, match=f"pid {os.getpid()}"):
        S3Lock(uri, client=s3.client()).acquire()  # another "host": its own client
    first.check()
    first.release()
    # Released: of many contenders at once, exactly one wins.
    locks = [S3Lock(uri, client=s3.client()) for _ in range(6)]
    won, barrier = [], threading.Barrier(len(locks))

    def contend(lock):
        barrier.wait()
        try:
            lock.acquire()
            won.append(lock)
        except Locked:
            pass

    threads = [threading.Thread(target=contend, args=(lk,)) for lk in locks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(won) == 1
    won[0].release()


def test_s3_lock_of_a_dead_holder_expires(s3, tmp_path):
    from rayspeed.retrain.lock import Locked, LockLost, S3Lock

    uri = _lock_uri(s3.bucket())
    code = (f"import time; from rayspeed.retrain.lock import S3Lock; S3Lock({uri!r}, ttl_s=3).acquire(); "
            "print('held', flush=True); time.sleep(600)")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    holder = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        time.sleep(2)  # it renews every ttl/3 while it lives
        with pytest.raises(Locked):
            S3Lock(uri, ttl_s=3).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    time.sleep(4)  # no renewal since the kill: stale (its own ttl_s, 3 s, says when)
    taker = S3Lock(uri, ttl_s=1).acquire()
    taker.check()
    # A holder whose lock was taken over finds out before it promotes.
    taker._stop.set()  # stops renewing, as if it hung
    time.sleep(2)
    other = S3Lock(uri).acquire()
    with pytest.raises(LockLost):
        taker.check()
    other.release()
    taker.release()  # its own object is gone: nothing to delete, no error


def test_cycles_on_s3_storage_share_the_lock(s3, home):
    from rayspeed.retrain.cycle import run_cycle
    from rayspeed.retrain.lock import S3Lock

    bucket = s3.bucket()
    with S3Lock(_lock_uri(bucket)):  # a cycle of another host holds it
        r = run_cycle(_job(home), [f"storage.path=s3://{bucket}/runs"], launcher="local",
                      job_cmd=[sys.executable, "-c", "raise SystemExit(1)"])
    assert (r.outcome, r.exit_code) == ("skipped", 3), r.reason
    assert r.reason.startswith(f"locked: another retraining cycle holds s3://{bucket}/runs/.retrain/rt.lock")
    assert s3.keys(bucket, "runs/.retrain/") == []  # released, probes cleaned up
