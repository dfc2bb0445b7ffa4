"""Where `auto` puts a job's files, and when it must not guess."""

import os
from pathlib import Path

from rayspeed import paths
from rayspeed.config.load import parse


def test_auto_refuses_to_guess_off_a_single_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("RAYSPEED_HOME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    job = parse({})
    checkout = tmp_path / "repo"
    (checkout / "platform" / "rayspeed").mkdir(parents=True)
    assert paths.auto_home_problem(job, nodes=1, package_root=checkout) is None
    # More than one node: never, whatever the home.
    msg = paths.auto_home_problem(job, nodes=3, package_root=checkout)
    assert msg.startswith("storage.path and tracking.uri: auto would put") and "other 2 node(s)" in msg
    # `ray job submit --working-dir` runs the driver from a temporary copy.
    copy = tmp_path / "ray" / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_ab12"
    (copy / "platform" / "rayspeed").mkdir(parents=True)
    msg = paths.auto_home_problem(job, nodes=1, package_root=copy)
    assert "temporary copy" in msg and "RAYSPEED_HOME" in msg
    # An installed package (site-packages) is no checkout either.
    assert "installed" in paths.auto_home_problem(job, nodes=1, package_root=tmp_path / "lib" / "python3.11")
    # Said explicitly: RAYSPEED_HOME on one node, or the keys themselves, or MLFLOW_TRACKING_URI for tracking.
    monkeypatch.setenv("RAYSPEED_HOME", str(tmp_path))
    assert paths.auto_home_problem(job, nodes=1, package_root=copy) is None
    explicit = parse({"storage": {"path": str(tmp_path / "runs")}, "tracking": {"uri": "http://mlflow:5000"}})
    assert paths.auto_home_problem(explicit, nodes=4, package_root=copy) is None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    only_storage = paths.auto_home_problem(job, nodes=4)
    assert only_storage.startswith("storage.path: auto")


def test_data_and_model_caches_follow_storage(tmp_path):
    assert paths.data_cache_dir(str(tmp_path), "auto", "job") == str(tmp_path / ".cache" / "data")
    assert paths.data_cache_dir("s3://b/runs", str(tmp_path), "job") == str(Path(tmp_path) / "job" / ".cache" / "data")
    assert paths.model_cache_dir("s3://b/runs") is None


def test_scratch_of_a_killed_process_is_deleted_by_the_next_one(tmp_path, monkeypatch):
    import socket
    import subprocess
    import sys
    import tempfile

    from rayspeed.paths import owned_scratch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # a process that made its folder and was killed before it could delete it
    child = subprocess.run([sys.executable, "-c", "from rayspeed.paths import owned_scratch as o; print(o('x-'))"],
                           capture_output=True, text=True, check=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    dead = Path(child.stdout.strip())
    (dead / "chart.png").write_bytes(b"png")
    host = socket.gethostname().replace("-", "_")[:40]
    other_host = tmp_path / "x-otherhost-1-abcd"  # another host sharing /tmp: never ours to judge
    other_host.mkdir()
    other_prefix = tmp_path / f"y-{host}-999999999-abcd"  # a dead pid, another prefix: not ours either
    other_prefix.mkdir()
    assert dead.is_dir() and dead.parent == tmp_path

    mine = Path(owned_scratch("x-"))
    assert not dead.exists()
    again = Path(owned_scratch("x-"))  # the owner of `mine` (this process) is alive: kept
    assert mine.is_dir() and again.is_dir() and other_host.is_dir() and other_prefix.is_dir()
    assert mine.name.startswith(f"x-{host}-{os.getpid()}-")
