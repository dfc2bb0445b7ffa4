"""The checkpoint commit protocol: only manifest-verified checkpoints exist for resume and pruning."""

import json
import os

from rayspeed.checkpoint import manifest


def make(root, step, files=None, commit=True):
    d = root / manifest.dir_name(step)
    d.mkdir(parents=True)
    for name, data in (files or {"ds/model.pt": b"weights" * step, "rng_rank0.pt": b"rng"}).items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    if commit:
        manifest.write_manifest(d, step, {"world_size": 2})
    return d


def test_manifest_records_sizes_and_hashes(tmp_path):
    d = make(tmp_path, 10)
    m = json.loads((d / "manifest.json").read_text())
    assert m["step"] == 10 and m["world_size"] == 2
    assert set(m["files"]) == {"ds/model.pt", "rng_rank0.pt"}
    assert m["files"]["rng_rank0.pt"]["bytes"] == 3 and len(m["files"]["rng_rank0.pt"]["sha256"]) == 64
    assert not (d / "manifest.json.tmp").exists()
    assert manifest.verify(d).ok


def test_uncommitted_truncated_or_corrupt_is_rejected(tmp_path):
    partial = make(tmp_path, 30, commit=False)
    assert "no readable manifest" in manifest.verify(partial).reason
    trunc = make(tmp_path, 20)
    with open(trunc / "ds/model.pt", "r+b") as fh:
        fh.truncate(3)
    assert "bytes" in manifest.verify(trunc).reason
    flipped = make(tmp_path, 15)
    data = bytearray((flipped / "ds/model.pt").read_bytes())
    data[0] ^= 1
    (flipped / "ds/model.pt").write_bytes(bytes(data))
    assert "sha256" in manifest.verify(flipped).reason
    assert manifest.verify(flipped, deep=False).ok  # same size: only the hash catches it
    good = make(tmp_path, 10)
    latest, skipped = manifest.latest_verified(tmp_path)
    assert latest == good and len(skipped) == 3


def test_torn_manifest_is_not_a_checkpoint(tmp_path):
    d = make(tmp_path, 5)
    (d / "manifest.json").write_text('{"step": 5, "fil')
    assert not manifest.verify(d).ok


def test_prune_keeps_newest_verified_and_spares_newer_partial(tmp_path):
    for s in (5, 10, 15, 20):
        make(tmp_path, s)
    make(tmp_path, 25, commit=False)  # being written right now
    make(tmp_path, 12, commit=False)  # an old partial write
    removed = {p.name for p in manifest.prune(tmp_path, keep=2)}
    assert removed == {manifest.dir_name(5), manifest.dir_name(10), manifest.dir_name(12)}
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [manifest.dir_name(15), manifest.dir_name(20), manifest.dir_name(25)]


def test_prune_never_keeps_fewer_than_two(tmp_path):
    for s in (1, 2, 3):
        make(tmp_path, s)
    manifest.prune(tmp_path, keep=1)
    assert len(os.listdir(tmp_path)) == 2
