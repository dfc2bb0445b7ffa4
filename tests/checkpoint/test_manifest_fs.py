"""The checkpoint manifest protocol on pyarrow filesystems (what Ray Train's storage accepts: s3://, gs://, ...),
without a network: a real S3 API (moto's server on 127.0.0.1, tests/_moto.py) behind s3:// URIs, a local
directory behind file:// URIs, and explicit `filesystem=` arguments (LocalFileSystem, and SubTreeFileSystem,
which has no atomic-rename guarantee of its own). The same checks as tests/test_checkpoint_store.py, plus: URIs
come back as URIs, the object-store commit (one PUT, no temporary object) and interoperability with checkpoints
written locally."""

import json

import pytest
from pyarrow import fs as pafs

from rayspeed import paths, storage
from rayspeed.checkpoint import manifest


class Backend:
    """A checkpoint root on one kind of storage; `put`/`get` write and read files through its filesystem."""

    def __init__(self, kind, tmp_path, s3=None):
        self.kind = kind
        self.kw = {}
        if kind == "s3":
            self.root = f"s3://{s3.bucket()}/runs/job"
        elif kind == "file-uri":
            (tmp_path / "runs").mkdir()
            self.root = (tmp_path / "runs").as_uri()
        elif kind == "local-fs":
            (tmp_path / "runs").mkdir()
            self.root = str(tmp_path / "runs")
            self.kw = {"filesystem": pafs.LocalFileSystem()}
        elif kind == "subtree-fs":
            (tmp_path / "sub").mkdir()
            self.root = "runs/job"
            self.kw = {"filesystem": pafs.SubTreeFileSystem(str(tmp_path / "sub"), pafs.LocalFileSystem())}
        resolved = storage.resolve(self.root, **self.kw)
        if resolved is None:  # file:// URIs are local paths: plain filesystem code
            self.fs, self.base = pafs.LocalFileSystem(), str(tmp_path / "runs")
        else:
            self.fs, self.base = resolved.fs, resolved.fs_path

    def join(self, *parts):
        """A path in the form callers use for this backend (URI, local path or filesystem path)."""
        return "/".join([self.root.rstrip("/"), *parts])

    def _fs_path(self, *parts):
        return "/".join([self.base.rstrip("/"), *parts])

    def put(self, rel, data):
        p = self._fs_path(rel)
        self.fs.create_dir(p.rsplit("/", 1)[0], recursive=True)
        with self.fs.open_output_stream(p) as fh:
            fh.write(data)

    def get(self, rel):
        with self.fs.open_input_stream(self._fs_path(rel)) as fh:
            return fh.read()

    def exists(self, rel):
        return self.fs.get_file_info(self._fs_path(rel)).type != pafs.FileType.NotFound

    def listdir(self):
        sel = pafs.FileSelector(self.base, allow_not_found=True)
        return sorted(i.path.rstrip("/").rsplit("/", 1)[-1] for i in self.fs.get_file_info(sel))


@pytest.fixture(params=["s3", "file-uri", "local-fs", "subtree-fs"])
def backend(request, tmp_path):
    return Backend(request.param, tmp_path, request.getfixturevalue("s3") if request.param == "s3" else None)


def make(b, step, files=None, commit=True):
    d = manifest.dir_name(step)
    for name, data in (files or {"ds/model.pt": b"weights" * step, "rng_rank0.pt": b"rng"}).items():
        b.put(f"{d}/{name}", data)
    if commit:
        manifest.write_manifest(b.join(d), step, {"world_size": 2}, **b.kw)
    return b.join(d)


def test_manifest_records_sizes_and_hashes(backend):
    d = make(backend, 10)
    name = manifest.dir_name(10)
    m = json.loads(backend.get(f"{name}/manifest.json"))
    assert m["step"] == 10 and m["world_size"] == 2 and m["format"] == manifest.FORMAT_VERSION
    assert set(m["files"]) == {"ds/model.pt", "rng_rank0.pt"}
    assert m["files"]["rng_rank0.pt"]["bytes"] == 3 and len(m["files"]["rng_rank0.pt"]["sha256"]) == 64
    assert not backend.exists(f"{name}/manifest.json.tmp")
    assert manifest.verify(d, **backend.kw).ok
    assert manifest.read_manifest(d, **backend.kw)["step"] == 10
    assert sorted(map(str, manifest.list_files(d, **backend.kw))) == ["ds/model.pt", "rng_rank0.pt"]


def test_uncommitted_truncated_or_corrupt_is_rejected(backend):
    kw = backend.kw
    partial = make(backend, 30, commit=False)
    assert "no readable manifest" in manifest.verify(partial, **kw).reason
    trunc = make(backend, 20)
    backend.put(f"{manifest.dir_name(20)}/ds/model.pt", b"wei")
    assert "bytes" in manifest.verify(trunc, **kw).reason
    flipped = make(backend, 15)
    data = bytearray(backend.get(f"{manifest.dir_name(15)}/ds/model.pt"))
    data[0] ^= 1
    backend.put(f"{manifest.dir_name(15)}/ds/model.pt", bytes(data))
    assert "sha256" in manifest.verify(flipped, **kw).reason
    assert manifest.verify(flipped, deep=False, **kw).ok  # same size: only the hash catches it
    missing = make(backend, 12)
    backend.fs.delete_file(f"{backend.base.rstrip('/')}/{manifest.dir_name(12)}/rng_rank0.pt")
    assert "missing" in manifest.verify(missing, **kw).reason
    good = make(backend, 10)
    latest, skipped = manifest.latest_verified(backend.root, **kw)
    assert str(latest) == str(good) or (backend.kind == "file-uri" and str(latest).endswith(manifest.dir_name(10)))
    assert len(skipped) == 4


def test_torn_manifest_is_not_a_checkpoint(backend):
    d = make(backend, 5)
    backend.put(f"{manifest.dir_name(5)}/manifest.json", b'{"step": 5, "fil')
    assert not manifest.verify(d, **backend.kw).ok


def test_prune_keeps_newest_verified_and_spares_newer_partial(backend):
    for s in (5, 10, 15, 20):
        make(backend, s)
    make(backend, 25, commit=False)  # being written right now
    make(backend, 12, commit=False)  # an old partial write
    removed = {str(p).rstrip("/").rsplit("/", 1)[-1] for p in manifest.prune(backend.root, keep=2, **backend.kw)}
    assert removed == {manifest.dir_name(5), manifest.dir_name(10), manifest.dir_name(12)}
    assert backend.listdir() == [manifest.dir_name(15), manifest.dir_name(20), manifest.dir_name(25)]


def test_candidates_newest_first_in_the_callers_form(backend):
    for s in (3, 11, 7):
        make(backend, s)
    backend.put("not_a_checkpoint/x", b"x")
    found = manifest.candidates(backend.root, **backend.kw)
    assert [manifest.step_of(p) for p in found] == [11, 7, 3]
    if backend.kind == "s3":  # URIs stay URIs, and resolve to the same bucket
        assert all(str(p).startswith(backend.root + "/") for p in found)
        assert manifest.verify(found[0]).ok
    assert manifest.candidates(backend.join("nowhere"), **backend.kw) == []


def test_object_store_commit_is_one_put(tmp_path, s3):
    """On S3/GCS/Azure (no rename) the manifest is written in one PUT; no temporary object is ever created. With
    the bucket versioned, S3 itself keeps every PUT and every delete: a write-then-move would leave a version of
    manifest.json.tmp and its delete marker."""
    b = Backend("s3", tmp_path, s3)
    bucket, prefix = b.root[len("s3://"):].split("/", 1)
    client = s3.client()
    client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    d = make(b, 10, commit=False)
    manifest.write_manifest(d, 10, {"world_size": 1})
    key = f"{prefix}/{manifest.dir_name(10)}/manifest.json"
    history = client.list_object_versions(Bucket=bucket, Prefix=key)
    assert [v["Key"] for v in history.get("Versions", [])] == [key], history.get("Versions")
    assert history.get("DeleteMarkers", []) == []
    assert manifest.verify(d).ok


def test_local_checkpoint_verifies_through_pyarrow(tmp_path):
    """One protocol: a checkpoint committed through the local code path verifies through pyarrow and back."""
    d = tmp_path / manifest.dir_name(40)
    (d / "ds").mkdir(parents=True)
    (d / "ds" / "model.pt").write_bytes(b"w" * 100)
    manifest.write_manifest(d, 40, {"world_size": 4})
    assert manifest.verify(str(d), filesystem=pafs.LocalFileSystem()).ok
    assert manifest.verify(d.as_uri()).ok
    d2 = tmp_path / manifest.dir_name(50)
    (d2 / "ds").mkdir(parents=True)
    (d2 / "ds" / "model.pt").write_bytes(b"v" * 10)
    manifest.write_manifest(str(d2), 50, {"world_size": 4}, filesystem=pafs.LocalFileSystem())
    assert manifest.verify(d2).ok
    assert manifest.latest_verified(tmp_path)[0] == d2


def test_local_paths_are_not_uris():
    assert not paths.is_uri("/mnt/nfs/runs") and not paths.is_uri("file:///mnt/nfs/runs")
    assert paths.is_uri("s3://bucket/runs") and paths.is_uri("gs://bucket/runs")
    assert storage.resolve("/mnt/nfs/runs") is None
    assert manifest.step_of("s3://bucket/runs/job/checkpoint_step00000042") == 42
