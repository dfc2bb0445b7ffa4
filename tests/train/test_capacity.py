"""resilience.stability_threshold: an elastic job does not (re)start below that fraction of its maximum; it waits
for capacity up to resilience.capacity_wait_s, then fails naming both keys."""

import pytest

from _cluster import ROOT, run_job
from rayspeed.config.schema import ClusterConfig

TINY = str(ROOT / "configs" / "tiny-cpu.yaml")


@pytest.mark.parametrize("workers,threshold,least", [
    ([1, 4], 0.7, 3), ([2, 4], 0.0, 2), ([1, 2], 0.7, 2), ([1, 2], 0.5, 1), ([4, 8], 0.7, 6), ([1, 10], 0.7, 7),
])
def test_effective_minimum(workers, threshold, least):
    assert ClusterConfig(num_workers=workers).effective_min_workers(threshold) == least


@pytest.mark.ray
def test_too_little_capacity_waits_then_fails_naming_both_keys(tmp_path):
    """[1, 4] workers need 3 (0.7 x 4) to start; the embedded cluster declares 2 CPUs (2 one-CPU workers)."""
    r, summary = run_job(tmp_path, ["--config", TINY, "--set", "name=capacity", "--set", "cluster.num_workers=[1, 4]",
                                    "--set", "cluster.local_num_cpus=2", "--set", "resilience.capacity_wait_s=5",
                                    "--set", "resilience.max_failures=0"], None, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "a (re)start needs at least 3" in out  # said at launch
    assert summary["status"] == "failed" and summary["steps"] == 0
    assert "resilience.stability_threshold" in summary["error"] and "resilience.capacity_wait_s" in summary["error"]
