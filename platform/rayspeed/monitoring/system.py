"""System metrics of every rank, gathered to rank 0 (which alone talks to MLflow).

    sampler = SystemSampler(rank, node_id)            # background thread, one per worker process
    ...
    snap = sampler.snapshot()                         # averages since the last snapshot (cheap, local)
    metrics = gather_system_metrics(snap, groups)     # (system_gather) at log steps; dict on rank 0, None elsewhere
    tracker.log_metrics(metrics, step)                # rank 0

Per rank (names under `system/node{n}/rank{r}/`):
  cpu_percent          CPU utilization of the whole node, % (psutil.cpu_percent)
  proc_cpu_percent     CPU used by this rank's process, % of one core (can exceed 100 with threads)
  rss_gib              resident memory of this rank's process
  host_mem_percent     node memory in use, %
  on GPU (torch.cuda available):
  gpu_util_percent     GPU utilization, % (torch.cuda.utilization / pynvml, else nvidia-smi, else omitted)
  gpu_mem_allocated_gib, gpu_mem_reserved_gib, gpu_mem_peak_gib
  gpu_mem_fragmentation  inactive split bytes / reserved bytes (torch.cuda.memory_stats: the share of the
                         caching allocator's reserved memory held in free pieces of blocks still partly in use,
                         which a new tensor larger than each piece cannot use: fragmentation proper, not the idle
                         cache that 1 - allocated/reserved would count)
Plus, on GPU, the job-level `memory/peak_allocated_gib` (max over ranks) and `memory/fragmentation`
(worst rank, averaged over the window).

Nothing here may stop training: every sample is best-effort and the collective always runs (with an
empty dict if the snapshot failed) so no rank is left waiting.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
from typing import Any, Optional

log = logging.getLogger(__name__)

GIB = float(1 << 30)


# ------------------------------------------------------------------------------------------- GPU helpers
def _cuda_device() -> Optional[int]:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.current_device()
    except Exception:
        pass
    return None


def parse_nvidia_smi(text: str) -> list[dict[str, Any]]:
    """Rows of `nvidia-smi --query-gpu=index,uuid,pci.bus_id,utilization.gpu --format=csv,noheader,nounits`."""
    rows = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        try:
            util = float(parts[3])
        except ValueError:  # "[N/A]" on some virtualised GPUs
            continue
        rows.append({"index": parts[0], "uuid": parts[1], "bus_id": parts[2].lower(), "util": util})
    return rows


def _match_gpu(rows: list[dict[str, Any]], uuid: str | None, bus_id: str | None, visible_index: int) -> Optional[float]:
    """The utilization row of our device: by UUID, else by PCI bus id, else by CUDA_VISIBLE_DEVICES position."""
    if uuid:
        u = uuid.lower().replace("gpu-", "")
        for r in rows:
            if r["uuid"].lower().replace("gpu-", "") == u:
                return r["util"]
    if bus_id:
        b = bus_id.lower()
        for r in rows:
            # nvidia-smi prints an 8-digit domain ("00000000:18:00.0"), torch a 4-digit one.
            if r["bus_id"].endswith(b[-7:]):
                return r["util"]
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    want = visible[visible_index] if visible_index < len(visible) else str(visible_index)
    for r in rows:
        if r["index"] == want or r["uuid"] == want:
            return r["util"]
    return None


class _GpuUtil:
    """GPU utilization of one torch device: torch.cuda.utilization (pynvml), else nvidia-smi, else nothing."""

    def __init__(self, device: int):
        import torch

        self.device = device
        self.method: Optional[str] = None
        self.uuid = self.bus_id = None
        try:
            props = torch.cuda.get_device_properties(device)
            self.uuid = str(getattr(props, "uuid", "") or "") or None
            dom, bus, dev = (getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
            if bus is not None:
                self.bus_id = f"{dom or 0:04x}:{bus:02x}:{dev or 0:02x}.0"
        except Exception:
            pass
        try:
            torch.cuda.utilization(device)
            self.method = "nvml"
        except Exception:
            if shutil.which("nvidia-smi") and self._smi() is not None:
                self.method = "nvidia-smi"
        if self.method is None:
            log.info("GPU utilization unavailable (no pynvml, no nvidia-smi): system/*/gpu_util_percent omitted")

    def _smi(self) -> Optional[float]:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid,pci.bus_id,utilization.gpu", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout
        return _match_gpu(parse_nvidia_smi(out), self.uuid, self.bus_id, self.device)

    def read(self) -> Optional[float]:
        import torch

        try:
            if self.method == "nvml":
                return float(torch.cuda.utilization(self.device))
            if self.method == "nvidia-smi":
                return self._smi()
        except Exception:
            return None
        return None


def cuda_memory(device: int) -> dict[str, float]:
    """Caching-allocator numbers of one device, in GiB, and the fragmentation index (one memory_stats read)."""
    import torch

    stats = torch.cuda.memory_stats(device)
    out = {
        "gpu_mem_allocated_gib": stats.get("allocated_bytes.all.current", 0) / GIB,
        "gpu_mem_reserved_gib": stats.get("reserved_bytes.all.current", 0) / GIB,
        "gpu_mem_peak_gib": stats.get("allocated_bytes.all.peak", 0) / GIB,
    }
    frag = fragmentation(stats)
    if frag is not None:
        out["gpu_mem_fragmentation"] = frag
    return out


def fragmentation(stats: dict[str, Any]) -> Optional[float]:
    """The allocator's fragmentation from a torch.cuda.memory_stats() dict: inactive split bytes / reserved bytes
    (`inactive_split_bytes.all.current` / `reserved_bytes.all.current`): free bytes inside blocks that are split
    and partly in use, so only a tensor no larger than each free piece can use them (PyTorch's "non-releasable
    memory"). Cached blocks that are entirely free are not fragmentation: a later tensor reuses them whole.
    None when nothing is reserved (or the stats do not say)."""
    reserved = float(stats.get("reserved_bytes.all.current", 0) or 0)
    if reserved <= 0 or "inactive_split_bytes.all.current" not in stats:
        return None
    return max(0.0, min(1.0, float(stats["inactive_split_bytes.all.current"]) / reserved))


# ------------------------------------------------------------------------------------------- sampler
_NODE_ID: Optional[str] = None


class SystemSampler:
    """Samples this process's node every interval_s on a daemon thread; snapshot() averages the window.

    Peak values (gpu_mem_peak_gib) are maxima over the window, everything else is a mean. Construct it
    in the worker after the CUDA device is set (it remembers torch.cuda.current_device()).
    """

    def __init__(self, rank: int, node_id: Any, interval_s: float = 5.0, start: bool = True):
        global _NODE_ID
        self.rank = int(rank)
        self.node_id = str(node_id)
        _NODE_ID = self.node_id  # gather_system_metrics(dict) labels this process's node with it
        self.interval_s = max(0.05, float(interval_s))
        self._lock = threading.Lock()
        self._sums: dict[str, float] = {}
        self._maxes: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._proc = None
        self._psutil = None
        self._gpu: Optional[_GpuUtil] = None
        self.device = _cuda_device()
        self._failed_once = False
        try:
            import psutil

            self._psutil = psutil
            self._proc = psutil.Process()
            psutil.cpu_percent(None)  # prime: the first call has no interval to measure
            self._proc.cpu_percent(None)
        except Exception as e:
            log.warning("psutil unavailable (%s): CPU and host memory metrics omitted", e)
        if self.device is not None:
            try:
                self._gpu = _GpuUtil(self.device)
            except Exception as e:
                log.warning("GPU utilization probe failed (%s): gpu_util_percent omitted", e)
        if start:
            self.start()

    # -- lifecycle
    def start(self) -> "SystemSampler":
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="rayspeed-sysmon", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None:
            t.join(timeout=2 * self.interval_s + 5)

    close = stop

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    # -- sampling
    def _read(self) -> dict[str, float]:
        vals: dict[str, float] = {}
        ps = self._psutil
        if ps is not None:
            vals["cpu_percent"] = float(ps.cpu_percent(None))
            vals["proc_cpu_percent"] = float(self._proc.cpu_percent(None))
            vals["rss_gib"] = self._proc.memory_info().rss / GIB
            vals["host_mem_percent"] = float(ps.virtual_memory().percent)
        if self.device is not None:
            vals.update(cuda_memory(self.device))
            if self._gpu is not None:
                u = self._gpu.read()
                if u is not None:
                    vals["gpu_util_percent"] = u
        return vals

    def sample(self) -> None:
        """One sample into the current window (the thread calls this; safe to call from anywhere)."""
        try:
            vals = self._read()
        except Exception as e:
            if not self._failed_once:
                log.warning("system metrics sample failed (%s); continuing", e)
                self._failed_once = True
            return
        with self._lock:
            for k, v in vals.items():
                self._sums[k] = self._sums.get(k, 0.0) + v
                self._counts[k] = self._counts.get(k, 0) + 1
                self._maxes[k] = max(self._maxes.get(k, v), v)

    def snapshot(self) -> dict[str, float]:
        """Means since the last snapshot (maxima for peaks); samples once now if the window is empty."""
        try:
            with self._lock:
                empty = not self._counts
            if empty:
                self.sample()
            with self._lock:
                sums, counts, maxes = self._sums, self._counts, self._maxes
                self._sums, self._counts, self._maxes = {}, {}, {}
            out = {}
            for k, n in counts.items():
                out[k] = maxes[k] if k.endswith("_peak_gib") else sums[k] / n
            if "gpu_mem_fragmentation" in maxes:
                out["gpu_mem_fragmentation_max"] = maxes["gpu_mem_fragmentation"]
            return out
        except Exception as e:  # never raise into the training loop
            log.warning("system metrics snapshot failed (%s)", e)
            return {}


def node_labels(node_ids: list[str]) -> list[int]:
    """Node index per rank: nodes numbered in order of their lowest rank (Ray's node_rank order)."""
    order: dict[str, int] = {}
    out = []
    for nid in node_ids:
        if nid not in order:
            order[nid] = len(order)
        out.append(order[nid])
    return out


def node_label() -> str:
    """This process's node, as the SystemSampler built here names it, else the hostname."""
    return _NODE_ID or _hostname()


def _hostname() -> str:
    import socket

    return socket.gethostname()


# ------------------------------------------------------------------------------------------- lineage params
def git_commit(repo: str | os.PathLike | None = None) -> str:
    """HEAD of the repository the job was launched from (RAYSPEED_HOME), 'unknown' if not a git checkout.
    A dirty tree is marked with a '-dirty' suffix."""
    if repo is None:
        from rayspeed.paths import home

        repo = home()
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return os.environ.get("RAYSPEED_GIT_COMMIT", "unknown")


def cluster_shape(node_ids_by_rank: list[Any], use_gpu: bool) -> dict[str, Any]:
    """Params describing where the job ran: nodes, workers per node, device kind."""
    labels = node_labels([str(n) for n in node_ids_by_rank])
    per_node: dict[int, int] = {}
    for n in labels:
        per_node[n] = per_node.get(n, 0) + 1
    shape = {
        "cluster_shape.nodes": len(per_node),
        "cluster_shape.workers": len(labels),
        "cluster_shape.workers_per_node": ",".join(str(per_node[n]) for n in sorted(per_node)),
        "cluster_shape.device": "cpu",
    }
    if use_gpu:
        try:
            import torch

            shape["cluster_shape.device"] = torch.cuda.get_device_name(torch.cuda.current_device())
        except Exception:
            shape["cluster_shape.device"] = "gpu"
    return shape


def lineage_params(node_ids_by_rank: list[Any] | None = None, use_gpu: bool = False) -> dict[str, Any]:
    """git commit, cluster shape and the versions the worker's own _versions() does not record.
    Cheap and never raises; for rank 0's log_params at start."""
    out: dict[str, Any] = {}
    try:
        import platform as _stdlib_platform  # the stdlib module (rayspeed's src dir is not a package)

        out["versions.python"] = _stdlib_platform.python_version()
        out["git.commit"] = git_commit()
        if node_ids_by_rank:
            out.update(cluster_shape(node_ids_by_rank, use_gpu))
        try:
            import torch

            out["versions.cudnn"] = str(torch.backends.cudnn.version()) if use_gpu else "none"
        except Exception:
            pass
    except Exception as e:
        log.warning("lineage params incomplete (%s)", e)
    return out
