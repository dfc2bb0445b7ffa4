"""What one node has: GPUs, driver, CUDA, NCCL, torch, DeepSpeed, Ray and Python versions, CPUs, memory, NUMA.

collect() runs on the node being described (a Ray task pinned to it). Versions come from package metadata, not
imports: importing DeepSpeed takes seconds and may probe the GPU.
"""

from __future__ import annotations

import os
import platform as _platform
import shutil
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _numa_nodes() -> list[int]:
    base = Path("/sys/devices/system/node")
    try:
        return sorted(int(p.name[4:]) for p in base.glob("node[0-9]*"))
    except OSError:
        return []


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _nvidia_smi(query: str) -> list[list[str]]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        r = subprocess.run([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits"], capture_output=True,
                           text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if r.returncode != 0:
        return []
    return [[c.strip() for c in line.split(",")] for line in r.stdout.strip().splitlines() if line.strip()]


def gpus() -> list[dict[str, Any]]:
    """Per GPU: index, name, memory (MiB), driver, and clocks/temperature where nvidia-smi answers."""
    rows = _nvidia_smi("index,name,memory.total,driver_version,pci.bus_id,temperature.gpu,clocks.sm,clocks.max.sm")
    keys = ["index", "name", "memory_mib", "driver", "pci_bus_id", "temperature_c", "sm_clock_mhz", "sm_clock_max_mhz"]
    return [dict(zip(keys, r)) for r in rows]


def collect() -> dict[str, Any]:
    smi = gpus()
    inv: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "os": f"{_platform.system()} {_platform.release()}",
        "python": _platform.python_version(),
        "cpus": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "numa_nodes": _numa_nodes(),
        "torch": _version("torch"),
        "deepspeed": _version("deepspeed"),
        "ray": _version("ray"),
        "cuda": None,
        "nccl": None,
        "gpu_count": len(smi),
        "gpus": smi,
        "driver": smi[0]["driver"] if smi else None,
    }
    if smi:
        # Only a GPU node pays for importing torch (seconds): the CUDA and NCCL versions torch was built with.
        import torch

        inv["cuda"] = torch.version.cuda
        try:  # the NCCL torch was built with; needs no visible device (Ray may hide them from this task)
            inv["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # a CPU or ROCm build
            pass
    return inv
