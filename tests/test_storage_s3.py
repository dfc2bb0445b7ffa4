"""Storage helpers, the manifest protocol and checkpoint staging against a real S3 API (moto's server), plus
the local fast path and the config errors for storage.path. No Ray."""

import json
import subprocess
import sys

import pytest

from _cluster import ROOT
from rayspeed import storage
from rayspeed.checkpoint import manifest, staging

TINY = str(ROOT / "configs" / "tiny-cpu.yaml")


def test_small_files_round_trip_on_s3(s3):
    bucket = s3.bucket()
    exp = storage.locate(f"s3://{bucket}/runs").child("job")
    assert not exp.is_local and exp.uri == f"s3://{bucket}/runs/job"
    exp.mkdirs()
    assert exp.read_json("summary.json") == {} and not exp.exists("summary.json")
    exp.write_json("summary.json", {"status": "finished", "steps": 3})
    assert exp.read_json("summary.json") == {"status": "finished", "steps": 3}
    exp.append_jsonl(".resilience/events.jsonl", {"kind": "failure", "time": 1.0})
    exp.append_jsonl(".resilience/events.jsonl", {"kind": "resize", "time": 2.0})
    assert [e["kind"] for e in exp.read_jsonl(".resilience/events.jsonl")] == ["failure", "resize"]
    # One object per file, no temporaries left behind (object stores commit with one PUT).
    assert s3.keys(bucket) == ["runs/job/.resilience/events.jsonl", "runs/job/summary.json"]
    exp.delete("summary.json")
    assert not exp.exists("summary.json")


def test_resilience_records_on_s3(s3):
    from rayspeed.train import resilience

    exp = f"s3://{s3.bucket()}/runs/job"
    cb = resilience.ResilienceCallback(exp)
    cb._record("failure", ranks=[1], causes={"1": "killed"})
    e = resilience.pending_event(exp)
    assert e["kind"] == "failure" and e["ranks"] == [1]
    resilience.mark_recovered(exp, {"recovery_s": 3.0})
    assert resilience.pending_event(exp) is None
    assert resilience.read_progress(exp) == {}


def _fake_checkpoint(d, rank, step):
    (d / "ds").mkdir(parents=True, exist_ok=True)
    (d / "ds" / f"zero_pp_rank_{rank}_optim_states.pt").write_bytes(bytes([rank]) * (1000 + step))
    (d / f"rng_rank{rank}.pt").write_bytes(b"rng%d" % rank)


def test_staged_checkpoint_commits_and_restores_through_s3(s3, tmp_path):
    """Two ranks stage, hash and upload their own files; rank 0 commits the manifest; a node downloads and
    verifies the newest checkpoint. A manifest-less upload never counts; a corrupted object is caught at staging."""
    bucket = s3.bucket()
    exp = storage.locate(f"s3://{bucket}/runs/job")
    node = staging.node_dir(tmp_path / "staging", "job", "node-a:1")
    for step in (5, 10):
        files = {}
        for rank in (0, 1):
            d = staging.save_dir(node, rank, step)
            _fake_checkpoint(d, rank, step)
            files.update(staging.publish(exp, d))
            assert not d.exists()  # staging cleaned after upload
        manifest.write_manifest(str(exp.child(manifest.dir_name(step))), step, {"world_size": 2}, files)
    # A newer checkpoint whose manifest never got written (the writer died): uploaded shards only.
    d = staging.save_dir(node, 0, 15)
    _fake_checkpoint(d, 0, 15)
    staging.publish(exp, d)

    keys = s3.keys(bucket, "runs/job/")
    assert "runs/job/checkpoint_step00000010/manifest.json" in keys
    assert "runs/job/checkpoint_step00000015/manifest.json" not in keys
    assert not [k for k in keys if k.endswith(".tmp")]
    m = manifest.read_manifest(str(exp.child("checkpoint_step00000010")))
    assert sorted(m["files"]) == ["ds/zero_pp_rank_0_optim_states.pt", "ds/zero_pp_rank_1_optim_states.pt",
                                  "rng_rank0.pt", "rng_rank1.pt"]

    from rayspeed.checkpoint import resume

    chosen = resume.choose(str(exp), deep=False)
    assert chosen == f"s3://{bucket}/runs/job/checkpoint_step00000010"
    local = staging.fetch(exp, "checkpoint_step00000010", node)
    assert (local / "ds" / "zero_pp_rank_1_optim_states.pt").read_bytes() == bytes([1]) * 1010
    assert manifest.verify(local).ok

    # Same size, different bytes: only the sha256 on the staged copy can tell.
    s3.client().put_object(Bucket=bucket, Key="runs/job/checkpoint_step00000010/rng_rank1.pt", Body=b"RNG1")
    assert manifest.verify(str(exp.child("checkpoint_step00000010")), deep=False).ok
    with pytest.raises(RuntimeError, match="rng_rank1.pt does not match its sha256"):
        staging.fetch(exp, "checkpoint_step00000010", node)
    assert not (node / "load" / "checkpoint_step00000010").exists()
    # ...and marks it rejected: the next attempt resumes from the older one instead of failing on it again.
    v = manifest.verify(str(exp.child("checkpoint_step00000010")), deep=False)
    assert not v.ok and "rejected earlier" in v.reason and "rng_rank1.pt" in v.reason
    assert resume.choose(str(exp), deep=False) == \
        f"s3://{bucket}/runs/job/checkpoint_step00000005"

    # Retention in the store: prune keeps the newest verified ones and never touches newer unverified ones.
    for step in (20, 25):
        d = staging.save_dir(node, 0, step)
        _fake_checkpoint(d, 0, step)
        manifest.write_manifest(str(exp.child(manifest.dir_name(step))), step, {"world_size": 1},
                                staging.publish(exp, d))
    removed = [manifest.step_of(p) for p in manifest.prune(str(exp), keep=2)]
    assert sorted(removed) == [5, 10, 15]
    assert [manifest.step_of(p) for p in manifest.candidates(str(exp))] == [25, 20]


def test_local_paths_take_the_plain_filesystem(tmp_path):
    exp = storage.locate(str(tmp_path / "runs")).child("job")
    assert exp.is_local and exp.local == tmp_path / "runs" / "job"
    exp.write_json("summary.json", {"a": 1})
    assert json.loads((tmp_path / "runs" / "job" / "summary.json").read_text()) == {"a": 1}
    assert storage.locate((tmp_path / "x").as_uri()).is_local


def test_check_reachable_names_the_key_and_the_fix(s3):
    bucket = s3.bucket()
    assert storage.check_reachable(f"s3://{bucket}/runs") is None
    assert storage.check_reachable("/abs/local/path") is None
    missing = storage.check_reachable("s3://rayspeed-no-such-bucket-x/runs")
    assert missing.startswith("storage.path: bucket 'rayspeed-no-such-bucket-x'") and "create it" in missing


def _train(args, env):
    return subprocess.run([sys.executable, str(ROOT / "jobs" / "train.py"), "--config", TINY, *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_bad_storage_uri_is_a_config_error(s3, tmp_path):
    import os

    env = dict(os.environ, RAYSPEED_HOME=str(tmp_path))
    r = _train(["--set", "storage.path=bogus://bucket/runs"], env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().startswith("config error: storage.path:") and "s3://bucket/prefix" in r.stderr
    assert "Traceback" not in r.stderr

    r = _train(["--set", "storage.path=s3://rayspeed-no-such-bucket-y/runs"], env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "storage.path: bucket 'rayspeed-no-such-bucket-y'" in r.stderr and "Traceback" not in r.stderr

    # An endpoint nothing listens on: unreachable, said in one line, not after a traceback.
    r = _train(["--set", f"storage.path=s3://{s3.bucket()}/runs"], dict(env, AWS_ENDPOINT_URL="http://127.0.0.1:9"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "storage.path: the bucket of" in r.stderr and "AWS_ENDPOINT_URL" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    # Nothing written: no MLflow store, no runs folder.
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "runs").exists()
