"""Safe promotion: the cycle lock holds across hosts on object storage (S3 conditional writes, against moto's real
S3 server; refused where no such lock exists), the champion is re-read before the alias moves, and a champion and
its challenger are compared like with like. The "training job" of a cycle is a stub here (tests/retrain's real
end-to-end cycles are in test_retrain.py): it registers a prepared model in a real MLflow store (SQLite in
tmp_path) and writes the job's summary, and can act as another host that promotes meanwhile."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
REG = "rayspeed-rt"

STUB = r'''
import json, os, sys
from pathlib import Path
sets = [a for p, a in zip(sys.argv, sys.argv[1:]) if p == "--set"]
name = next(s.split("=", 1)[1] for s in sets if s.startswith("name="))
reg = json.loads(next(s.split("=", 1)[1] for s in sets if s.startswith("tracking.register_model=")))
uri = os.environ["MLFLOW_TRACKING_URI"]
from rayspeed.tracking.client import mlflow_client
from rayspeed.tracking.registry import log_and_register, set_alias
c = mlflow_client(uri)
exp = c.get_experiment_by_name("stub")
from rayspeed.paths import artifact_root
exp_id = exp.experiment_id if exp else c.create_experiment("stub", artifact_location=artifact_root(uri))
def register(model_dir, val):
    run = c.create_run(exp_id).info.run_id
    return run, log_and_register(uri, run, model_dir, reg, metrics={"val/loss": val})
run, version = register(os.environ["STUB_MODEL_DIR"], float(os.environ["STUB_VAL_LOSS"]))
if os.environ.get("STUB_OTHER_HOST_PROMOTES"):  # meanwhile, another cycle promotes its own version
    _, other = register(os.environ["STUB_OTHER_HOST_PROMOTES"], 0.5)
    set_alias(uri, reg, other)
out = Path(os.environ["RAYSPEED_HOME"]) / "runs" / name
out.mkdir(parents=True, exist_ok=True)
(out / "summary.json").write_text(json.dumps({"status": "finished", "val_loss": float(os.environ["STUB_VAL_LOSS"]),
                                              "mlflow_run_id": run, "registered_model_version": version}))
'''


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSPEED_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "platform"), os.environ.get("PYTHONPATH", "")]))
    return tmp_path


def _job(home: Path) -> str:
    corpus = home / "corpus"
    corpus.mkdir(exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for n in ("json/__init__.py", "json/decoder.py"):
        shutil.copy(stdlib / n, corpus / n.replace("/", "_"))
    cfg = home / "job.yaml"
    cfg.write_text(f"""
name: rt
model: {{hidden_size: 32, num_layers: 1, num_heads: 2, ffn_hidden_size: 64, vocab_size: 256, seq_len: 32}}
data: {{source: files, path: "{corpus}/*.py", tokenizer: bytes, val_fraction: 0.1}}
train: {{global_batch_size: 8, max_steps: 6, eval_batches: 2}}
cluster: {{num_workers: 1}}
""")
    return str(cfg)


def _export(home: Path, cfg_path: str, name: str, scale: float = 1.0) -> str:
    """A rayspeed export of the job's model, randomly initialised; scale > 1 makes its logits (and loss) worse."""
    import torch

    from rayspeed.config.load import load
    from rayspeed.config.shape import ModelShape
    from rayspeed.model.export import export_model
    from rayspeed.model.transformer import Transformer

    cfg = load(cfg_path)
    model = Transformer(ModelShape.from_config(cfg.model), tp=None, seed=1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    out = home / "exports" / name
    export_model(model, SimpleNamespace(name="rt", model=cfg.model, train=SimpleNamespace(seed=1, precision="fp32"),
                                        parallel=None), str(out))
    return str(out)


def _champion(home: Path, model_dir: str, val: float, data_hash: str | None = None) -> None:
    """Version 1 of REG, under the alias champion, as an earlier cycle would have left it."""
    from rayspeed.tracking.client import mlflow_client
    from rayspeed.tracking.registry import log_and_register, set_alias

    uri = f"sqlite:///{home / 'mlflow.db'}"
    c = mlflow_client(uri)
    run = c.create_run(c.create_experiment("earlier", artifact_location=(home / "mlartifacts").as_uri())).info.run_id
    v = log_and_register(uri, run, model_dir, REG, metrics={"val/loss": val},
                         extra_tags={"rayspeed.data_hash": data_hash} if data_hash else None)
    assert v == "1" and set_alias(uri, REG, v)


def _stub(home: Path) -> list[str]:
    path = home / "stub_job.py"
    path.write_text(STUB)
    return [sys.executable, str(path)]


def _client(home: Path):
    from rayspeed.tracking.client import mlflow_client

    return mlflow_client(f"sqlite:///{home / 'mlflow.db'}")


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
