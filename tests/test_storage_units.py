"""Small storage/resilience rules that need no cluster: the progress record, forwarded credentials,
what a checkpoint manifest may list."""

import time

from rayspeed.checkpoint import manifest
from rayspeed.storage import forwarded_env
from rayspeed.train import resilience


def test_progress_is_not_overwritten_before_the_first_step(tmp_path):
    """The previous attempt's last step must survive until the restarted rank 0 has read it (lost_steps)."""
    resilience.write_progress(tmp_path, 11)
    rec = resilience.ProgressRecorder(tmp_path, interval_s=0.05)
    time.sleep(0.3)  # several ticks of the publishing thread
    assert resilience.read_progress(tmp_path)["step"] == 11
    rec.update(12)
    time.sleep(0.3)
    assert resilience.read_progress(tmp_path)["step"] == 12
    rec.update(13)
    rec.close()  # the last step is written on close
    assert resilience.read_progress(tmp_path)["step"] == 13


def test_remote_clusters_get_credentials_but_not_driver_paths():
    env = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_ENDPOINT_URL": "http://minio:9000",
           "AWS_PROFILE": "dev", "AWS_SHARED_CREDENTIALS_FILE": "/home/me/.aws/credentials",
           "GOOGLE_APPLICATION_CREDENTIALS": "/home/me/key.json", "HOME": "/home/me"}
    assert forwarded_env(env) == {k: v for k, v in env.items() if k != "HOME"}  # same machine: all of them
    assert forwarded_env(env, remote=True) == {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                                               "AWS_ENDPOINT_URL": "http://minio:9000"}


def test_a_rejection_marker_never_enters_a_manifest(tmp_path):
    d = tmp_path / manifest.dir_name(10)
    (d / "ds").mkdir(parents=True)
    (d / "ds" / "shard.pt").write_bytes(b"x" * 10)
    (d / manifest.REJECTED).write_text('{"reason": "old"}')
    assert [str(p) for p in manifest.list_files(d)] == ["ds/shard.pt"]


def test_listing_a_folder_survives_a_concurrent_atomic_write(tmp_path):
    """An async save's rank 0 lists the marker folder while another rank writes its marker (temp file, then rename):
    a temp file renamed away between the listing and its stat is not an error (it failed a CI run:
    test_async_protocol's rank 0 got FileNotFoundError). Before the fix this loop hit it tens of times."""
    import threading

    from rayspeed import storage

    loc = storage.locate(str(tmp_path))
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            loc.write_json("m/rank1.json", {"i": i})
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(2000):
            assert [rel for rel, _ in loc.child("m").files() if not rel.endswith(".tmp")] in ([], ["rank1.json"])
    finally:
        stop.set()
        t.join()
