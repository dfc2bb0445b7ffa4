"""`nvidia-smi topo -m` parsing, slow-rank flagging and the node inventory (no GPU needed)."""

import pytest

from rayspeed.health import analysis, inventory, topology
from rayspeed.planner import hardware

# An 8 x H100 SXM node as nvidia-smi prints it: tab-separated, the header underlined with ANSI codes.
DGX = (
    "\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    + "".join(
        f"GPU{i}\t" + "\t".join(" X " if j == i else "NV18" for j in range(8))
        + f"\t{'PIX' if i == 0 else 'SYS'}\t{'0-55,112-167' if i < 4 else '56-111,168-223'}"
          f"\t{0 if i < 4 else 1}\t\tN/A\n"
        for i in range(8))
    + "NIC0\tPIX\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t X \n"
    + "\nLegend:\n\n  X    = Self\n  SYS  = Connection traversing PCIe as well as the SMP interconnect\n"
    + "  NV#  = Connection traversing a bonded set of # NVLinks\n\nNIC Legend:\n\n  NIC0: mlx5_0\n"
)

# A 4 x L40S workstation pasted from a terminal (spaces), PCIe only, NVLink nowhere.
PCIE = """        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity
GPU0     X      PXB     SYS     SYS     0-31            0
GPU1    PXB      X      SYS     SYS     0-31            0
GPU2    SYS     SYS      X      PXB     32-63           1
GPU3    SYS     SYS     PXB      X      32-63           1

Legend:
"""

# Two NVLink-bridged pairs: NVLink inside each pair, PCIe between them.
PAIRS = """\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV4\tPHB\tPHB\t0-23\t0
GPU1\tNV4\t X \tPHB\tPHB\t0-23\t0
GPU2\tPHB\tPHB\t X \tNV4\t0-23\t0
GPU3\tPHB\tPHB\tNV4\t X \t0-23\t0
"""


def test_parse_full_nvlink_node():
    t = topology.parse_topo(DGX)
    assert t["gpus"] == [f"GPU{i}" for i in range(8)] and t["nics"] == ["NIC0"]
    assert len(t["pairs"]) == 28 and t["nvlink_pairs"] == 28 and t["pcie_pairs"] == 0
    assert t["pairs"][0] == {"a": "GPU0", "b": "GPU1", "link": "NV18", "kind": "nvlink", "nvlinks": 18}
    assert t["affinity"]["GPU5"] == {"cpu": "56-111,168-223", "numa": "1"}
    assert t["numa_nodes"] == ["0", "1"]
    ids = [f.id for f in topology.findings(t, "10.0.0.1")]
    assert ids == ["gpus_span_numa"]  # all NVLink; two sockets -> bind workers to their NUMA node


def test_parse_pcie_only_space_separated():
    t = topology.parse_topo(PCIE)
    assert t["nvlink_pairs"] == 0 and t["pcie_pairs"] == 6
    kinds = {(p["a"], p["b"]): p["kind"] for p in t["pairs"]}
    assert kinds[("GPU0", "GPU1")] == "pcie" and kinds[("GPU0", "GPU2")] == "cross_numa"
    assert t["affinity"]["GPU2"]["numa"] == "1"
    fs = topology.findings(t)
    assert {f.id for f in fs} == {"gpu_pairs_without_nvlink", "gpus_span_numa"}
    assert next(f for f in fs if f.id == "gpu_pairs_without_nvlink").severity == "info"


def test_partial_nvlink_is_flagged():
    t = topology.parse_topo(PAIRS)
    assert t["nvlink_pairs"] == 2 and t["pcie_pairs"] == 4
    (f,) = topology.findings(t)
    assert f.id == "gpu_pairs_without_nvlink" and f.severity == "warn" and "4 of 6" in f.cause


def test_not_a_topology():
    with pytest.raises(ValueError):
        topology.parse_topo("No devices were found\n")


def test_probe_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(topology.shutil, "which", lambda name: None)
    assert topology.probe() == {"available": False, "reason": "nvidia-smi not found (no NVIDIA driver on this node)"}


def test_inventory_on_this_node():
    inv = inventory.collect()
    for key in ("hostname", "torch", "deepspeed", "ray", "python", "cpus", "cuda", "nccl", "gpus", "driver"):
        assert key in inv
    assert inv["torch"] and inv["deepspeed"] and inv["ray"]


def test_outliers_compare_with_the_others():
    assert analysis.outliers({0: 10.0, 1: 10.5, 2: 9.8, 3: 2.0}, 0.5) == [(3, 2.0, 10.0)]
    assert analysis.outliers({0: 10.0, 1: 4.0}, 0.5) == [(1, 4.0, 10.0)]
    assert analysis.outliers({0: 10.0, 1: 6.0}, 0.5) == []


def test_slow_rank_and_node_findings():
    ranks = [{"rank": r, "node": "a" if r < 4 else "b", "matmul_gflops": 100.0, "copy_gbps": 50.0,
              "link_gbps": 20.0 if r < 4 else 4.0} for r in range(8)]
    ranks[2]["matmul_gflops"] = 30.0
    fs = analysis.rank_findings(ranks, 0.5)
    slow = {(f.id, f.extra.get("metric"), f.extra.get("rank", f.extra.get("node"))) for f in fs}
    assert ("slow_rank", "matmul_gflops", 2) in slow
    assert ("slow_node", "link_gbps", "b") in slow
    assert all(f.category == "slow_rank" for f in fs)


def test_bandwidth_against_the_hardware_table():
    hw = hardware.get("h100-sxm-80gb")
    rows = [{"bytes": 1 << 30, "busbw_gbps": 100.0, "ok": True, "ranks": 8}]
    (f,) = analysis.bandwidth_findings(rows, hw, nodes=1)
    assert f.id == "low_busbw" and f.severity == "warn" and f.extra["expected_gbps"] == hw.intra_node_gbps
    # across nodes the network per GPU is the reference: 35 GB/s is fine there
    rows[0]["busbw_gbps"] = 35.0
    assert analysis.bandwidth_findings(rows, hw, nodes=2) == []
    rows[0]["ok"] = False
    assert [f.id for f in analysis.bandwidth_findings(rows, hw, nodes=2)] == ["collective_wrong_result"]
    assert analysis.hardware_for("NVIDIA H200", use_gpu=True).name == "h200"
    assert analysis.hardware_for("NVIDIA A100-SXM4-40GB", use_gpu=True).name == "a100-40gb"
    assert analysis.hardware_for(None).name == "cpu"


def test_gpu_ranks_against_the_hardware_table():
    hw = hardware.get("h100-sxm-80gb")
    ranks = [{"rank": 0, "node": "a", "matmul_gflops": 700_000.0, "copy_gbps": 2900.0},
             {"rank": 1, "node": "a", "matmul_gflops": 150_000.0, "copy_gbps": 2900.0}]
    (f,) = analysis.device_findings(ranks, hw)
    assert f.extra["rank"] == 1 and f.extra["metric"] == "matmul_gflops" and "h100-sxm-80gb" in f.evidence[0]
    assert analysis.device_findings(ranks, hardware.get("cpu")) == []
