"""Collective sweeps and the preflight on a real 2-process gloo world
(one spawn for all of it: start-up is the cost)."""

import dataclasses
import os
import time

import pytest

from _dist import run_distributed
from rayspeed.health.collectives import busbw_factor, default_sizes


def test_busbw_factors_follow_nccl_tests():
    assert busbw_factor("allreduce", 2) == 1.0
    assert busbw_factor("allreduce", 8) == pytest.approx(2 * 7 / 8)
    assert busbw_factor("allgather", 8) == pytest.approx(7 / 8)
    assert busbw_factor("reducescatter", 4) == pytest.approx(3 / 4)
    assert busbw_factor("allreduce", 1) == 1.0


def test_default_sizes_double_from_1k():
    cpu = default_sizes("cpu")
    assert cpu[0] == 1024 and cpu[-1] == 16 << 20 and len(cpu) >= 8
    assert all(b == 2 * a for a, b in zip(cpu, cpu[1:]))


def _cfg(**health):
    from rayspeed.config.schema import JobConfig

    cfg = JobConfig()
    return dataclasses.replace(cfg, health=dataclasses.replace(cfg.health, **health))


def _world(rank, world):
    from rayspeed.health import PreflightError, allgather_sweep, allreduce_sweep, run_preflight
    from rayspeed.parallel.groups import ParallelGroups

    out = {}
    sizes = [1 << 10, 1 << 14, 1 << 18, 1 << 20]
    out["allreduce"] = allreduce_sweep(sizes=sizes, iters=2, warmup=1)
    out["allgather"] = allgather_sweep(sizes=sizes, iters=2, warmup=1)

    groups = ParallelGroups(world, 1, 1)
    t0 = time.perf_counter()
    out["preflight"] = run_preflight(_cfg(), groups, "cpu").to_json()
    out["preflight_s"] = time.perf_counter() - t0

    def failing(cfg):
        try:
            run_preflight(cfg, groups, "cpu")
        except PreflightError as e:
            return e.reason
        return None

    # A bandwidth floor nothing on loopback reaches.
    out["floor"] = failing(_cfg(preflight_min_busbw_gbps=1e6))
    # An invented variable on rank 1 only: every rank must fail, with the same reason.
    if rank == 1:
        os.environ["NCCL_SOCKET_TIMEOUT"] = "600"
    out["lint"] = failing(_cfg())
    os.environ.pop("NCCL_SOCKET_TIMEOUT", None)
    # A debug knob is fine when the run is not production.
    os.environ["NCCL_DEBUG"] = "INFO"
    out["debug_ok"] = failing(_cfg(production=False))
    out["debug_prod"] = failing(_cfg())
    os.environ.pop("NCCL_DEBUG", None)
    return out


@pytest.fixture(scope="module")
def world_results():
    return run_distributed(_world, 2, timeout_s=60)


def test_allreduce_sweep_reports_busbw_per_size(world_results):
    r0, r1 = world_results
    rows = r0["allreduce"]
    assert [r["bytes"] for r in rows] == [1 << 10, 1 << 14, 1 << 18, 1 << 20]
    assert all(r["ok"] and r["busbw_gbps"] > 0 and r["ranks"] == 2 for r in rows)
    # 2 ranks: busbw = algbw x 2(n-1)/n = algbw
    assert all(r["busbw_gbps"] == pytest.approx(r["algbw_gbps"], rel=1e-3, abs=1e-5) for r in rows)
    # the slowest rank's time is reported, so both ranks return the same table
    assert r0["allreduce"] == r1["allreduce"]


def test_allgather_sweep_counts_the_output_size(world_results):
    rows = world_results[0]["allgather"]
    assert [r["bytes"] for r in rows] == [1 << 10, 1 << 14, 1 << 18, 1 << 20]
    assert all(r["ok"] for r in rows)
    assert all(r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] / 2, rel=1e-2, abs=1e-5) for r in rows)


def test_preflight_passes_fast_on_two_cpu_workers(world_results):
    rep = world_results[0]["preflight"]
    assert rep["ok"] and rep["world_size"] == 2 and rep["backend"] == "gloo"
    assert len(rep["allreduce"]) >= 3 and all(r["ok"] for r in rep["allreduce"])
    assert [r["rank"] for r in rep["ranks"]] == [0, 1]
    assert all(r["matmul_gflops"] > 0 and r["copy_gbps"] > 0 and r["link_gbps"] > 0 for r in rep["ranks"])
    assert world_results[0]["preflight_s"] < 2.0, world_results[0]["preflight_s"]


def test_preflight_fails_every_rank_with_the_reason(world_results):
    r0, r1 = world_results
    assert "preflight_min_busbw_gbps" in r0["floor"] and r0["floor"] == r1["floor"]
    # rank 1's bad variable fails rank 0 too, naming the variable, the rank and the replacement
    assert r0["lint"] == r1["lint"]
    assert "NCCL_SOCKET_TIMEOUT=600 (rank 1)" in r0["lint"] and "collective_timeout_s" in r0["lint"]
    assert r0["debug_ok"] is None
    assert "NCCL_DEBUG=INFO" in r0["debug_prod"] and "NCCL_DEBUG=WARN" in r0["debug_prod"]
