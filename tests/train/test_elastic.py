"""Node drill on a simulated two-node cluster (ray.cluster_utils.Cluster, one worker per node, the job joined
through RAY_ADDRESS): a node goes away mid-run and the job keeps training on one worker with the same
global batch; the node comes back and the job grows to two again. ZeRO state crosses the resize through
DeepSpeed's universal checkpoint. Recovery time is reported, not asserted (it is a benchmark figure)."""

import json
import os
import subprocess
import sys
import time

import pytest

from _cluster import ROOT, metric_history

pytestmark = pytest.mark.ray
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")


def _progress(home, name):
    try:
        return json.loads((home / "runs" / name / ".resilience" / "progress.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def _wait_for(pred, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


@pytest.mark.slow  # a heavier end-to-end drill: `make test-slow`
def test_node_loss_shrinks_and_regrows(tmp_path):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    nodes = [cluster.add_node(num_cpus=1, resources={"trainer": 1}) for _ in range(2)]
    cluster.wait_for_nodes()
    name = "node-drill"
    env = dict(os.environ, RAYSPEED_HOME=str(tmp_path), RAY_ADDRESS=cluster.address, PYTHONUNBUFFERED="1",
               RAY_AUTH_MODE="token")
    env.pop("MLFLOW_TRACKING_URI", None)
    log = open(tmp_path / "job.log", "w")
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "jobs" / "train.py"), "--config", TINY, "--set", f"name={name}",
         "--set", "cluster.num_workers=[1, 2]", "--set", "resilience.stability_threshold=0.5",
         "--set", "cluster.resources_per_worker={trainer: 1}",
         # Long enough that the node added back is in use before the end: Ray Train's controller sizes the group up
         # some 25 s after the node returns here (its autoscaling coordinator, then a 5 s monitor interval).
         "--set", "cluster.cpus_per_worker=1", "--set", "train.max_steps=1000",
         "--set", "resilience.checkpoint_every_steps=10", "--set", "resilience.elastic_monitor_interval_s=5",
         "--set", "tracking.log_every_steps=5", "--set", "train.eval_every_steps=0",
         # Several nodes: auto storage/tracking would not guess; these nodes share this machine's disk.
         "--set", f"storage.path={tmp_path / 'runs'}", "--set", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: _progress(tmp_path, name) >= 40, 300, "40 steps on 2 workers")
        cluster.remove_node(nodes[1])
        t_removed = time.time()
        removed_at = _progress(tmp_path, name)
        _wait_for(lambda: _progress(tmp_path, name) >= removed_at + 30, 300, "training on 1 worker")
        t_back = time.time()
        nodes[1] = cluster.add_node(num_cpus=1, resources={"trainer": 1})
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
        cluster.shutdown()
    out = (tmp_path / "job.log").read_text()
    assert rc == 0, out[-5000:]
    summary = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
    rid = summary["mlflow_run_id"]
    world = [int(v) for _, v in metric_history(tmp_path, rid, "resilience/world_size")]
    # 2 -> 1 -> 2, in that order (repeats within a phase are fine).
    phases = [w for i, w in enumerate(world) if i == 0 or world[i - 1] != w]
    assert phases[:3] == [2, 1, 2], world
    assert {v for _, v in metric_history(tmp_path, rid, "train/global_batch_size")} == {16.0}
    loss = metric_history(tmp_path, rid, "train/loss")
    first = loss[0][1]
    after = [v for s, v in loss if s > removed_at]
    assert max(after) < first - 1.0, "the loss jumped back towards its initial value after a resize"
    recoveries = [v for _, v in metric_history(tmp_path, rid, "resilience/recovery_s")]
    assert len(recoveries) >= 2
    print(f"\nnode drill: recovery_s after node loss {recoveries[0]:.1f}, after regrow {recoveries[1]:.1f}; "
          f"node removed at step {removed_at}, added back {t_back - t_removed:.0f} s later")
