"""Accelerator table: what the time and memory models need to know about one GPU (or one CPU worker).

Numbers are datasheet peaks (dense, no sparsity) and achievable (measured, not link-peak) bandwidths, each with
its source in docs/PLANNER.md. Precedence when planning: a calibrated hardware profile (`cluster.profile`,
`rayspeed plan --profile`) > the job's `cluster.hardware` overrides > this table.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

GIB = 1024**3


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: dict = field(default_factory=dict)
    """Dense peak per matmul dtype: bf16, fp16, fp32 (tf32 on Ampere+ when TF32 is allowed)."""
    memory_gib: float = 80.0
    """Device memory as the driver reports it (nvidia-smi total)."""
    hbm_gbps: float = 3350.0
    """Device memory bandwidth (GB/s): bounds element-wise work, small GEMMs, the optimizer step."""
    intra_node_gbps: float = 360.0
    """Achievable NCCL bus bandwidth of a ring collective inside one node at large messages (nccl-tests busbw),
    GB/s; also the point-to-point bandwidth between two GPUs of a node."""
    inter_node_gbps: float = 45.0
    """Achievable network bandwidth per GPU across nodes (its share of the node's NICs after protocol
    overhead), GB/s. A ring spanning nodes gets min(intra, ranks-per-node x this)."""
    intra_latency_us: float = 8.4
    """Fixed cost of one collective or send inside a node (NCCL's base latency, Simple protocol)."""
    inter_latency_us: float = 22.4
    """Fixed cost of one send across nodes (base + one network hop, NCCL tuning model)."""
    intra_hop_us: float = 3.4
    """Gloo/alpha-beta model only: added per algorithm step inside a node (GPUs use NCCL's hop table)."""
    inter_hop_us: float = 14.0
    """Gloo/alpha-beta model only: added per algorithm step across nodes."""
    intra_link: str = "nvlink"
    """nvlink | pci: which row of NCCL's latency table the node's links use."""
    nccl_latency_scale: float = 1.0
    """Measured / modelled collective latency (a calibrated profile sets it; 1 = NCCL's own model)."""
    gemm_efficiency: float = 0.80
    """Best fraction of peak a large GEMM reaches (790/989 measured on the H200 anchor)."""
    attention_efficiency: float = 0.35
    """Fraction of peak for fused (flash/SDPA) attention at head dim `attention_head_dim`, forward and backward
    together (FlashAttention-2 on H100 at head dim 128, causal FLOPs counted as executed)."""
    attention_head_dim: int = 128
    """Head dim at which attention_efficiency holds (a profile measures at the job's own)."""
    kernel_overhead_us: float = 6.0
    """Host time to launch one eager op; bounds tiny models (the GPU waits on Python)."""
    host_fwd_layer_us: float = 0.0
    """Measured host time of one block's forward (a calibrated profile); 0: ops x kernel_overhead_us."""
    host_bwd_layer_us: float = 0.0
    """Measured host time of one block's backward, the engine's gradient hooks included; 0: derived."""
    host_fixed_mb_us: float = 0.0
    """Measured host time per micro-batch outside the blocks (engine wrappers, embedding, head, loss); 0: none
    (on GPUs it hides behind the kernels)."""
    pipe_host_mb_us: float = 1000.0
    """DeepSpeed's pipeline engine's own host time per micro-batch on each stage beyond the blocks' (its 5-6
    instructions per micro-batch, input clones, blocking p2p calls): 1.0-7.2 ms measured on a 2-core VM under
    load (scripts/bench_pipeline_overhead.py, docs/PLANNER.md); the least contended run is used. On a GPU it runs
    beside the kernels (a floor per micro-batch), on a CPU after them."""
    engine_step_s: float = 0.005
    """DeepSpeed engine time per optimizer step beyond the optimizer's memory traffic (H200 anchor: ZeRO-1
    207.5 ms vs eager 193.2 ms at 774M, minus the Adam traffic)."""
    mem_efficiency: float = 0.8
    """Fraction of memory bandwidth element-wise kernels reach (STREAM-like copies on H100: ~80-90%)."""
    work_scale_fwd: float = 1.0
    """Measured / modelled time of one block's forward (host included) at a calibrated profile's reference layout
    (the job's own model through its engine at two depths): the block is anchored at what was measured, other
    layouts follow the model's ratio to the reference. 1: the model's parts as they are."""
    work_scale_bwd: float = 1.0
    """The same for one block's backward."""
    head_work_scale: float = 1.0
    """The same for what is not a block: embedding, final norm, head, loss and the engine's fixed time per
    micro-batch, forward and backward."""
    sm_count: int = 132
    """Streaming multiprocessors: GEMM tiles are scheduled in waves of this many (wave quantization)."""
    straggler_sigma: float = 0.012
    """Relative spread (1 sigma) of one GPU's speed across a cluster of identical GPUs: Sinha et al. (SC22,
    arXiv 2208.11035) measured 8% average performance variation (max 22%) between GPUs of one SKU; 8% as a
    +-3.3 sigma range gives 1.2%. A synchronous step waits for the slowest of n: + sigma sqrt(2 ln n)."""
    bf16: bool = True
    tf32: bool = True
    """TF32 tensor cores for fp32 matmuls (Ampere and newer)."""
    is_gpu: bool = True

    def peak(self, precision: str) -> float:
        """FLOP/s for matmuls in this precision."""
        key = precision
        if precision == "fp32" and self.tf32:
            key = "tf32"
        return self.peak_tflops.get(key, self.peak_tflops.get("fp32", 1.0)) * 1e12


_H100_SXM = Hardware(
    name="h100-sxm-80gb",
    peak_tflops={"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    memory_gib=79.6,  # 81559 MiB
    hbm_gbps=3350.0,
    intra_node_gbps=360.0,  # NVLink 4 (450 GB/s per direction): nccl-tests ring all_reduce busbw ~360 at 1 GiB
    inter_node_gbps=45.0,  # one 400 Gb/s NDR NIC per GPU = 50 GB/s; 4 x 8 B200 nodes reached 94% (ml-engineering)
    sm_count=132,
)

TABLE: dict[str, Hardware] = {
    "h100-sxm-80gb": _H100_SXM,
    "h200": dataclasses.replace(_H100_SXM, name="h200", memory_gib=140.4, hbm_gbps=4800.0),  # 143771 MiB HBM3e
    "h100-pcie-80gb": Hardware(
        name="h100-pcie-80gb",
        peak_tflops={"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
        memory_gib=79.6,
        hbm_gbps=2000.0,
        intra_node_gbps=40.0,  # PCIe Gen5 x16 (64 GB/s) through switches; NVLink bridges pair GPUs only
        inter_node_gbps=11.0,  # typically one 200 Gb/s NIC per two GPUs, ~90% achieved
        intra_link="pci",
        sm_count=114,
    ),
    "a100-80gb": Hardware(
        name="a100-80gb",
        peak_tflops={"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
        memory_gib=80.0,
        hbm_gbps=2039.0,
        intra_node_gbps=230.0,  # NVLink 3 (300 GB/s per direction), nccl-tests ~230
        inter_node_gbps=22.5,  # one 200 Gb/s HDR NIC per GPU = 25 GB/s; nccl-tests #119: 85-96% achieved
        sm_count=108,
    ),
    "a100-40gb": Hardware(
        name="a100-40gb",
        peak_tflops={"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
        memory_gib=40.0,
        hbm_gbps=1555.0,
        intra_node_gbps=230.0,
        inter_node_gbps=22.5,
        sm_count=108,
    ),
    "l40s": Hardware(
        name="l40s",
        peak_tflops={"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
        memory_gib=44.5,  # 46068 MiB GDDR6
        hbm_gbps=864.0,
        intra_node_gbps=20.0,  # PCIe Gen4 only, no NVLink
        inter_node_gbps=11.0,
        intra_link="pci",
        sm_count=142,
    ),
    # One CPU core per worker: fp32 AVX2/AVX-512 FMA (~100 GFLOP/s peak, PyTorch reaches ~60%),
    # ~8 GB/s of DRAM bandwidth per core, gloo collectives over loopback (~1.5 GB/s, ~60 us each),
    # and eager PyTorch op dispatch (~15 us per op on CPU).
    "cpu": Hardware(
        name="cpu",
        peak_tflops={"fp32": 0.1, "bf16": 0.05, "fp16": 0.02},
        memory_gib=0.0,  # filled from host RAM at planning time (cpu_memory_gib)
        hbm_gbps=8.0,
        intra_node_gbps=1.5,
        inter_node_gbps=1.0,  # 10 GbE
        intra_latency_us=60.0,
        inter_latency_us=150.0,
        intra_hop_us=20.0,
        inter_hop_us=60.0,
        gemm_efficiency=0.6,
        attention_efficiency=0.3,
        kernel_overhead_us=15.0,
        engine_step_s=0.006,  # `rayspeed calibrate` on the 2-core dev box: ZeRO-1 6.0 ms, ZeRO-2 7.1 ms per step
        sm_count=0,  # no waves: GEMMs split across cores by the BLAS
        straggler_sigma=0.0,
        bf16=False,
        tf32=False,
        is_gpu=False,
    ),
}

NAMES = tuple(TABLE)


def host_memory_gib() -> float:
    """Physical RAM of this host (planning on the head node; workers are assumed alike)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):
        return 16.0


def cpu_memory_gib(workers_on_host: int) -> float:
    """A conservative share of host RAM per CPU worker: half the RAM, split evenly (the rest is the OS,
    Ray's object store and the driver)."""
    return 0.5 * host_memory_gib() / max(1, workers_on_host)


def get(name: str, overrides: dict | None = None) -> Hardware:
    """Table entry by name, with fields replaced by `overrides` (unknown names are a KeyError)."""
    hw = TABLE[name]
    if overrides:
        fields = {f.name for f in dataclasses.fields(Hardware)}
        unknown = [k for k in overrides if k not in fields]
        if unknown:
            raise KeyError(f"unknown hardware field(s) {unknown}; known: {sorted(fields)}")
        hw = dataclasses.replace(hw, **overrides)
    return hw
