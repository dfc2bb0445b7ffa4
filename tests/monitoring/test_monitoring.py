"""Monitoring: system metrics gathered to rank 0, measured gradient-sync time under DeepSpeed ZeRO-2, and the
loss-landscape projection (restores the weights exactly). The distributed checks share one 2-process gloo
world (process start-up and the DeepSpeed import are the slow part)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from _deepspeed_world import MODEL, _batch, shared_world
from rayspeed.monitoring.comm_timer import CommTimer
from rayspeed.monitoring.landscape import _direction, loss_landscape, unavailable_reason
from rayspeed.monitoring.system import (
    SystemSampler,
    _match_gpu,
    cluster_shape,
    fragmentation,
    lineage_params,
    parse_nvidia_smi,
)
from rayspeed.monitoring.system_gather import flatten_system_metrics, gather_system_metrics

torch.set_num_threads(1)

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return shared_world(tmp_path_factory)


def test_zero2_grad_sync_fraction_is_measured(world):
    for r in world:
        assert r["zero2"][0] is None  # step 0 was not measured
        for last in r["zero2"][1:]:
            assert 0.0 < last["grad_sync_fraction"] < 1.0, last
            assert last["comm_s"] > 0 and last["step_s"] > last["comm_s"] and last["calls"] >= 1
        assert r["patched_inside"] == [False, True, True]  # wrappers only during measured steps
        assert not r["patched_after"]
        assert r["unmeasured_keeps_last"]
        assert set(r["zero2_metrics"]) >= {"comm/grad_sync_fraction"}


def test_dp1_grad_sync_fraction_is_zero(world):
    for r in world:
        assert r["dp1"] is not None, r["dp1_ops"]
        assert r["dp1"]["grad_sync_fraction"] == 0.0 and r["dp1"]["comm_s"] == 0.0 and r["dp1"]["step_s"] > 0


def test_system_metrics_gathered_on_rank0_grouped_by_node(world):
    g0, g1 = world[0]["gathered"], world[1]["gathered"]
    assert g1 is None
    for rank, node in ((0, 0), (1, 1)):
        for k in ("cpu_percent", "proc_cpu_percent", "rss_gib", "host_mem_percent", "grad_sync_fraction"):
            assert f"system/node{node}/rank{rank}/{k}" in g0, (k, sorted(g0))
        assert 0.0 <= g0[f"system/node{node}/rank{rank}/cpu_percent"] <= 100.0
        assert g0[f"system/node{node}/rank{rank}/rss_gib"] > 0.05
    assert g0["system/num_nodes"] == 2
    assert not any("gpu" in k for k in g0) and "memory/fragmentation" not in g0  # CPU: nothing invented


def test_later_system_gathers_send_numbers_and_a_new_name_regathers(world):
    """After the first gather the names are agreed: the next sends a row of numbers (no object gather), a snapshot
    with a new name gathers objects once more, and rank 0 gets every rank's values either way."""
    w0 = world[0]
    assert w0["object_gathers2"] == 0 and w0["object_gathers3"] == 1 and world[1]["gathered2"] is None
    g2, g3 = w0["gathered2"], w0["gathered3"]
    assert set(g2) == set(w0["gathered"])
    assert g2["system/node0/rank0/cpu_percent"] == 11.0 and g2["system/node1/rank1/cpu_percent"] == 12.0
    assert g3["system/node0/rank0/comm_s"] == 0.5 and g3["system/node1/rank1/comm_s"] == 1.5


def test_landscape_on_zero2_engine(world):
    a, b = world[0]["landscape"], world[1]["landscape"]
    assert "unavailable" not in a, a
    assert a["alphas"] == pytest.approx([-0.5, -0.25, 0.0, 0.25, 0.5])
    assert a["losses"] == pytest.approx(b["losses"], rel=1e-12)  # same directions, dp-averaged loss
    assert a["center_loss"] == pytest.approx(world[0]["direct_loss"], rel=1e-6)
    assert len(set(round(v, 6) for v in a["losses"])) == 5
    for r in world:
        assert r["restored"] and torch.isfinite(torch.tensor(r["after_loss"]))


# ------------------------------------------------------------------------------------------- single process
def _tiny_model(seed=1):
    from rayspeed.model import Transformer

    return Transformer(SimpleNamespace(**MODEL, tie_embeddings=True), seed=seed)


def test_landscape_1d_and_2d_restore_weights_exactly():
    model = _tiny_model()
    batches = [_batch(i, b=4) for i in range(2)]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(25):  # a few steps so the weights sit in a basin of these batches
        for x, y in batches:
            opt.zero_grad()
            model(x, y).backward()
            opt.step()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        direct = sum(float(model(x, y)) for x, y in batches) / 2
    r1 = loss_landscape(model, batches, None, seed=3, steps=7, span=1.0)
    assert len(r1["losses"]) == 7 and r1["center_loss"] == pytest.approx(direct, rel=1e-6)
    assert r1["losses"][0] > r1["center_loss"] and r1["losses"][-1] > r1["center_loss"]  # span 1 = weight scale
    r2 = loss_landscape(model, batches, lambda m, x, y: m(x, y), seed=3, steps=5, two_d=True, span=0.5)
    assert len(r2["grid"]) == 5 and all(len(row) == 5 for row in r2["grid"]) and r2["betas"] == r2["alphas"]
    assert r2["grid"][2][2] == pytest.approx(direct, rel=1e-6)
    assert r2["losses"] == r2["grid"][2]
    again = loss_landscape(model, batches, None, seed=3, steps=7, span=1.0)
    assert again["losses"] == r1["losses"]  # seeded
    assert model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_direction_is_filter_normalised():
    w = torch.nn.Parameter(torch.randn(6, 5) * torch.arange(1, 7).float().unsqueeze(1))
    d = _direction(w, torch.Generator().manual_seed(0), w.detach().norm(dim=1))
    assert torch.allclose(d.norm(dim=1), w.detach().norm(dim=1), rtol=1e-5)
    bias = torch.nn.Parameter(torch.ones(5))
    assert torch.count_nonzero(_direction(bias, torch.Generator().manual_seed(0), None)) == 0


def test_landscape_unavailable_layouts():
    model = _tiny_model()
    model.tp = SimpleNamespace(world_size=2)  # what a tp>1 Transformer carries
    assert "tensor parallel" in loss_landscape(model, [_batch(0)], None, seed=1)["unavailable"]
    model = _tiny_model()
    next(model.parameters()).ds_id = 0  # a ZeRO-3 partitioned parameter
    assert "ZeRO-3" in unavailable_reason(model)
    assert "no validation batches" in loss_landscape(_tiny_model(), [], None, seed=1)["unavailable"]
    broken = loss_landscape(_tiny_model(), [("not", "tensors")], None, seed=1)
    assert broken["unavailable"].startswith("computation failed")  # reported, never raised


def test_sampler_windows_and_cpu_fields():
    s = SystemSampler(0, "n", interval_s=0.05)
    try:
        busy = time.perf_counter() + 0.3
        while time.perf_counter() < busy:
            sum(i * i for i in range(1000))
        snap = s.snapshot()
        assert {"cpu_percent", "proc_cpu_percent", "rss_gib", "host_mem_percent"} <= set(snap)
        assert snap["proc_cpu_percent"] > 5.0  # this thread was busy
        assert s.snapshot()  # an empty window samples once instead of returning nothing
    finally:
        s.stop()
    assert not s._thread.is_alive()


def test_gather_single_process_and_flatten():
    m = gather_system_metrics({"cpu_percent": 12.0}, None, node_id="x")
    assert m["system/node0/rank0/cpu_percent"] == 12.0
    gpu = {"gpu_util_percent": 90.0, "gpu_mem_peak_gib": 3.0, "gpu_mem_fragmentation": 0.2}
    flat = flatten_system_metrics([
        (3, "n2", dict(gpu, gpu_mem_fragmentation=0.4)), (0, "n1", gpu), (1, "n1", dict(gpu, gpu_mem_peak_gib=5.0)),
        (2, "n2", gpu),
    ])
    assert flat["system/node1/rank3/gpu_mem_fragmentation"] == 0.4
    assert flat["system/node0/rank1/gpu_mem_peak_gib"] == 5.0
    assert flat["memory/peak_allocated_gib"] == 5.0 and flat["memory/fragmentation"] == 0.4


GIB_ = 1 << 30
# torch.cuda.memory_stats() of a device (the keys fragmentation reads, with torch's names; no GPU was available to
# record one, so the numbers are made up and every other key omitted): 10 GiB reserved, 6 GiB allocated, of the
# 4 GiB not allocated 1 GiB sits in split blocks that are partly in use, 3 GiB in whole cached blocks.
MEMORY_STATS = {
    "allocated_bytes.all.current": 6 * GIB_, "allocated_bytes.all.peak": 7 * GIB_,
    "reserved_bytes.all.current": 10 * GIB_, "reserved_bytes.all.peak": 10 * GIB_,
    "inactive_split_bytes.all.current": 1 * GIB_, "inactive_split_bytes.large_pool.current": 1 * GIB_,
    "inactive_split.all.current": 12, "segment.all.current": 40, "num_alloc_retries": 0, "num_ooms": 0,
}


def test_fragmentation_is_inactive_split_bytes_over_reserved():
    """Not 1 - allocated/reserved (0.4 here: mostly an idle cache a new tensor reuses whole) but the free bytes
    stranded in split blocks: 1 GiB of 10."""
    assert fragmentation(MEMORY_STATS) == pytest.approx(0.1)
    assert fragmentation({**MEMORY_STATS, "inactive_split_bytes.all.current": 0}) == 0.0
    assert fragmentation({"reserved_bytes.all.current": 0}) is None  # nothing reserved yet
    assert fragmentation({"reserved_bytes.all.current": GIB_}) is None  # the stats do not say


def test_nvidia_smi_parsing_and_device_matching(monkeypatch):
    text = ("0, GPU-aaaa-1111, 00000000:18:00.0, 37\n"
            "1, GPU-bbbb-2222, 00000000:3B:00.0, 91\n"
            "2, GPU-cccc-3333, 00000000:86:00.0, [N/A]\n")
    rows = parse_nvidia_smi(text)
    assert [r["util"] for r in rows] == [37.0, 91.0]
    assert _match_gpu(rows, "bbbb-2222", None, 0) == 91.0
    assert _match_gpu(rows, None, "0000:3b:00.0", 0) == 91.0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert _match_gpu(rows, None, None, 1) == 37.0


def test_comm_timer_without_deepspeed_is_harmless():
    t = CommTimer()
    with t.step(measure=True):
        pass
    assert t.last() is None and t.metrics() == {}
    with pytest.raises(ValueError):
        with t.step(measure=True):
            raise ValueError("the step's own error propagates")
    with CommTimer(enabled=False).step(measure=True):
        pass


def test_lineage_params():
    p = lineage_params(["a", "a", "b", "b"], use_gpu=False)
    assert p["cluster_shape.nodes"] == 2 and p["cluster_shape.workers_per_node"] == "2,2"
    assert p["git.commit"] and p["versions.python"]
    assert cluster_shape(["x"], False)["cluster_shape.device"] == "cpu"


def test_gpu_branch_with_a_fake_device(monkeypatch):
    """The CUDA side (no GPU here): allocator numbers, fragmentation, utilization via nvidia-smi."""
    import subprocess

    import rayspeed.monitoring.system as sysmod

    gib = 1 << 30
    # (allocated, reserved, peak, inactive split) bytes of two samples
    mem = iter([(2 * gib, 4 * gib, 3 * gib, 2 * gib), (3 * gib, 4 * gib, 5 * gib, 1 * gib)])
    state = {}

    def step():
        a, r, p, i = next(mem)
        state["stats"] = {"allocated_bytes.all.current": a, "reserved_bytes.all.current": r,
                          "allocated_bytes.all.peak": p, "inactive_split_bytes.all.current": i}

    monkeypatch.setattr(torch.cuda, "memory_stats", lambda d=None: state["stats"])

    def no_nvml(d=None):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "utilization", no_nvml)
    monkeypatch.setattr(sysmod.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    smi = "0, GPU-a, 00000000:18:00.0, 12\n1, GPU-b, 00000000:3B:00.0, 88\n"
    monkeypatch.setattr(sysmod.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=smi, stderr=""))
    gpu = sysmod._GpuUtil(0)
    assert gpu.method == "nvidia-smi" and gpu.read() == 88.0  # torch device 0 = physical GPU 1

    s = SystemSampler(3, "n0", start=False)
    s.device, s._gpu = 0, gpu
    for _ in range(2):
        step()
        s.sample()
    snap = s.snapshot()
    assert snap["gpu_util_percent"] == 88.0
    assert snap["gpu_mem_fragmentation"] == pytest.approx((0.5 + 0.25) / 2)
    assert snap["gpu_mem_peak_gib"] == 5.0 and snap["gpu_mem_allocated_gib"] == 2.5
    flat = flatten_system_metrics([(3, "n0", snap)])
    assert flat["memory/peak_allocated_gib"] == 5.0 and flat["memory/fragmentation"] == pytest.approx(0.375)
    assert flat["system/node0/rank3/gpu_util_percent"] == 88.0


def test_landscape_regenerated_directions_match_cached(monkeypatch):
    """Large models do not keep the directions: regenerating them per point gives the same numbers."""
    import rayspeed.monitoring.landscape as land

    model = _tiny_model()
    batches = [_batch(0)]
    cached = loss_landscape(model, batches, None, seed=4, steps=5, two_d=True)
    real = land._placement
    monkeypatch.setattr(land, "_placement", lambda d, w, b: (real(d, w, b)[0], False, None))
    regenerated = loss_landscape(model, batches, None, seed=4, steps=5, two_d=True)
    assert regenerated["grid"] == cached["grid"]
    monkeypatch.setattr(land, "_placement", lambda d, w, b: (real(d, w, b)[0], True, "not enough host memory"))
    assert "host memory" in loss_landscape(model, batches, None, seed=4)["unavailable"]
