"""End to end with storage.path on a real S3 API (moto's server): the same job and kill drill as
tests/test_train_ray.py, its checkpoints staged on local disk and committed in the bucket."""

import json

import pytest

from _cluster import ROOT, metric_history, run_job

TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
COMMON = ["--set", "train.max_steps=30", "--set", "parallel.zero_stage=2",
          "--set", "resilience.checkpoint_every_steps=5",
          "--set", "tracking.log_every_steps=1", "--set", "train.eval_every_steps=0",
          "--set", "tracking.loss_landscape=false"]


def _summary(s3, bucket, name):
    body = s3.client().get_object(Bucket=bucket, Key=f"runs/{name}/summary.json")["Body"].read()
    return json.loads(body)


def test_local_launcher_on_s3(s3, tmp_path):
    bucket = s3.bucket()
    staging = tmp_path / "staging"
    r, summary = run_job(tmp_path, ["--config", TINY, "--launcher", "local", "--set", "name=s3-local",
                                    "--set", f"storage.path=s3://{bucket}/runs",
                                    "--set", f"storage.staging_dir={staging}",
                                    "--set", "train.max_steps=10", "--set", "resilience.checkpoint_every_steps=5",
                                    "--set", "train.eval_every_steps=0", "--set", "tracking.loss_landscape=false"],
                         None, timeout=300, env_extra=s3.env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert summary["status"] == "finished" and summary["steps"] == 10
    keys = s3.keys(bucket)
    assert {"runs/s3-local/checkpoint_step00000005/manifest.json",
            "runs/s3-local/checkpoint_step00000010/manifest.json",
            "runs/s3-local/summary.json"} <= set(keys), keys
    assert _summary(s3, bucket, "s3-local")["mlflow_run_id"] == summary["mlflow_run_id"]
    assert not (tmp_path / "runs").exists()  # nothing of the experiment on local disk but staging
    assert not list(staging.rglob("*.pt")), "staging not cleaned after upload"


@pytest.mark.ray
@pytest.mark.slow  # a heavier end-to-end drill: `make test-slow`
def test_kill_drill_resumes_from_s3(s3, ray_head, tmp_path, zero2_reference):
    """Rank 1 dies at step 12 of 30; the job resumes from checkpoint_step10 downloaded from the bucket and logs
    the losses of an uninterrupted run (conftest's zero2_reference, on local disk)."""
    bucket = s3.bucket()
    staging = tmp_path / "staging"
    store = ["--set", f"storage.path=s3://{bucket}/runs", "--set", f"storage.staging_dir={staging}"]
    r, summary = run_job(tmp_path, ["--config", TINY, "--set", "name=s3-kill", *COMMON, *store,
                                    "--set", "chaos.kill_rank_at_step={rank: 1, step: 12}"],
                         ray_head.address, env_extra=s3.env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert summary["status"] == "finished" and summary["steps"] == 30 and summary["restarts"] == 1
    assert _summary(s3, bucket, "s3-kill")["restarts"] == 1
    keys = s3.keys(bucket, "runs/s3-kill/")
    manifests = sorted(k.split("/")[2] for k in keys if k.endswith("/manifest.json"))
    assert manifests == ["checkpoint_step00000025", "checkpoint_step00000030"], keys
    assert "runs/s3-kill/.resilience/events.jsonl" in keys and "runs/s3-kill/.chaos/kill_rank1_step12" in keys
    assert "resumed from checkpoint_step00000010 at step 10" in r.stderr + r.stdout
    assert not list(staging.rglob("*.pt")), "staging not cleaned after upload/load"

    loss = metric_history(tmp_path, summary["mlflow_run_id"], "train/loss")
    assert [s for s, _ in loss] == list(range(1, 31))  # the replayed step 11 is logged once
    for s, v in loss:
        assert v == pytest.approx(zero2_reference[s], rel=1e-5), f"step {s}: {v} vs uninterrupted {zero2_reference[s]}"
    recovery = summary["recovery_s"]
    print(f"\ns3 kill drill: restarts 1, resumed at step 10 from s3://{bucket}/runs/s3-kill, recovery_s "
          f"{recovery:.1f}, median checkpoint stall {summary['checkpoint_stall_s']:.2f} s")
