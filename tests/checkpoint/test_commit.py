"""The local commit: shards into a fresh hidden folder, each file fsynced and hashed, the manifest inside, then one
rename. A re-save of the same step never keeps a file of the older folder; RNG state loads without unpickling."""

import os
import random

import numpy as np
import torch

from rayspeed.checkpoint import manifest, rng


def _write(d, files):
    for rel, data in files.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def test_resave_into_an_existing_step_keeps_no_stale_file(tmp_path):
    final = tmp_path / manifest.dir_name(10)
    # An earlier save of step 10 at another world size (4 ranks), committed.
    _write(final, {f"ds/zero_pp_rank_{r}_mp_rank_00_optim_states.pt": b"old" * 10 for r in range(4)})
    manifest.write_manifest(final, 10, {"world_size": 4})
    # The re-save at 2 ranks goes to a fresh folder; the commit swaps it in.
    saving = manifest.saving_dir(tmp_path, 10)
    _write(saving, {f"ds/zero_pp_rank_{r}_mp_rank_00_optim_states.pt": b"new" * 20 for r in range(2)})
    entries = manifest.durable_entries(saving, manifest.list_files(saving))
    manifest.write_manifest(saving, 10, {"world_size": 2}, entries)
    assert manifest.candidates(tmp_path) == [final]  # the saving folder is never a candidate
    manifest.commit_dir(saving, final)
    assert sorted(str(p) for p in manifest.list_files(final)) == [
        "ds/zero_pp_rank_0_mp_rank_00_optim_states.pt", "ds/zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert manifest.read_manifest(final)["world_size"] == 2 and manifest.verify(final).ok
    assert not saving.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_every_file_is_fsynced_before_the_manifest_names_it(tmp_path, monkeypatch):
    _write(tmp_path, {"ds/a.pt": b"a" * 100, "ds/b.pt": b"b" * 50, "rng_rank0.pt": b"r"})
    synced = []
    real = os.fsync

    def record(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", record)
    entries = manifest.durable_entries(tmp_path, manifest.list_files(tmp_path))
    assert sorted(synced) == sorted(str(tmp_path / rel) for rel in entries)
    assert entries["ds/b.pt"]["bytes"] == 50 and len(entries["ds/a.pt"]["sha256"]) == 64


def test_crashed_saves_are_cleaned_and_never_resumed(tmp_path):
    done = tmp_path / manifest.dir_name(4)
    _write(done, {"x.pt": b"x"})
    manifest.write_manifest(done, 4, {})
    torn = manifest.saving_dir(tmp_path, 8)
    _write(torn, {"x.pt": b"y"})
    manifest.write_manifest(torn, 8, {})  # even a complete manifest: the rename never happened
    assert manifest.latest_verified(tmp_path)[0] == done
    assert manifest.clean_stale_saves(tmp_path) == [torn] and not torn.exists()


def test_rng_state_round_trips_and_loads_with_weights_only(tmp_path):
    rng.seed_all(7)
    random.random(), np.random.rand(), torch.rand(1)
    rng.save(tmp_path, 3)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    torch.load(tmp_path / rng.file_name(3), weights_only=True)  # no arbitrary unpickling needed
    rng.seed_all(99)
    assert rng.load(tmp_path, 3)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
    assert not rng.load(tmp_path, 4)
