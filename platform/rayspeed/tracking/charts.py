"""The field guide's five dashboard charts (PLAYBOOK B.8), rendered from the run's own MLflow history.

    paths = render_charts(tracking_uri, run_id, out_dir, landscape=res)   # five PNGs in out_dir
    tracker.log_artifact_dir(out_dir, "charts")                             # -> charts/*.png in the run

    utilization_heatmap.png   GPU utilization (CPU on CPU-only runs) per rank over training steps,
                              rows grouped by node
    grad_sync_fraction.png    comm/grad_sync_fraction over steps (measured time in gradient collectives
                              / step time)
    compute_comm_ratio.png    (1 - f) / f from the same series: compute seconds per communication second
    loss_landscape.png        loss along one or two filter-normalised random directions around the weights
                              (rayspeed.monitoring.landscape)
    memory_fragmentation.png  memory/fragmentation = inactive split bytes / reserved bytes of the CUDA caching
                              allocator over steps (worst rank), with each rank's own series behind it

A chart whose data does not exist (no GPU, dp=1, landscape not computed or impossible for the layout)
is still written and says why on the image. matplotlib is imported lazily and used through its
object-oriented API with the Agg canvas (no pyplot, no display, safe off the main thread).
ChartPublisher does the flush-render-upload cycle on a background thread for the training loop.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import textwrap
import threading
from typing import Any, Optional

from rayspeed.paths import owned_scratch
from rayspeed.tracking.client import mlflow_client
from rayspeed.tracking.run_history import LANDSCAPE_JSON, RunHistory, previous_landscape

log = logging.getLogger(__name__)

CHART_FILES = (
    "utilization_heatmap.png",
    "grad_sync_fraction.png",
    "compute_comm_ratio.png",
    "loss_landscape.png",
    "memory_fragmentation.png",
)
_SYS = re.compile(r"^system/node(\d+)/rank(\d+)/(.+)$")


# ------------------------------------------------------------------------------------------- drawing helpers
def _figure(w: float = 9.0, h: float = 4.8):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str, status: str = "data") -> str:
    """PNG with a tEXt Description: "data: <title>" or "no data: <reason>" (for tests and scripts)."""
    title = fig.get_suptitle()
    if not title and fig.axes:
        title = fig.axes[0].get_title()
    desc = status if status != "data" else f"data: {title}"
    fig.savefig(path, format="png", metadata={"Description": desc[:2000], "Software": "rayspeed charts"})
    return path


def _note(fig, text: str, **adjust: float) -> None:
    """A wrapped grey footnote under the axes, with the bottom margin sized to fit it and the x label."""
    w_in, h_in = fig.get_size_inches()
    lines = textwrap.wrap(text, max(40, int(w_in * 15)))
    fig.text(0.5, 0.1 / h_in, "\n".join(lines), ha="center", va="bottom", fontsize=8, color="0.35")
    bottom = (0.1 + 0.15 * len(lines) + 0.65) / h_in
    fig.subplots_adjust(bottom=min(0.5, bottom), **adjust)


def _unavailable(path: str, title: str, reason: str, run_name: str = "") -> str:
    """A chart that states why its data does not exist."""
    fig = _figure(9.0, 4.0)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_axis_off()
    fig.suptitle(title, fontsize=13, fontweight="bold")
    body = "\n".join(textwrap.wrap("No data: " + reason, 78))
    ax.text(0.5, 0.5, body, ha="center", va="center", fontsize=11, transform=ax.transAxes,
            bbox=dict(boxstyle="round,pad=0.8", facecolor="#f3f3f3", edgecolor="#999999"))
    if run_name:
        _note(fig, f"run: {run_name}")
    return _save(fig, path, status=f"no data: {reason}")


def _mark_restarts(ax, steps: list[int], text: bool = False) -> None:
    for i, s in enumerate(steps):
        ax.axvline(s, color="tab:red", linestyle=":", linewidth=1.5, label="restart" if i == 0 else None)
        if text:
            ax.annotate("restart", xy=(s, 1.0), xycoords=("data", "axes fraction"), xytext=(2, 2),
                        textcoords="offset points", fontsize=8, color="tab:red", va="bottom")


def _no_gpu_reason(h: RunHistory, what: str) -> str:
    gpu = h.on_gpu()
    if gpu is False:
        return f"{what} comes from the CUDA caching allocator; this run trained on CPUs (cluster.use_gpu=false)."
    return f"{what} was not logged in this run (no CUDA device seen by the workers)."


# ------------------------------------------------------------------------------------------- the five charts
def chart_utilization(h: RunHistory, path: str) -> str:
    title = "Utilization heatmap by rank, grouped by node"
    per_metric: dict[str, dict[tuple[int, int], str]] = {}
    for k in h.keys:
        m = _SYS.match(k)
        if m:
            per_metric.setdefault(m.group(3), {})[(int(m.group(1)), int(m.group(2)))] = k
    if "gpu_util_percent" in per_metric:
        metric, label, what = "gpu_util_percent", "GPU utilization (%)", "GPU utilization"
        note = "GPU utilization from NVML / nvidia-smi, averaged between log steps"
    elif "proc_cpu_percent" in per_metric:
        metric, label, what = "proc_cpu_percent", "process CPU (% of one core)", "CPU utilization (no GPU)"
        note = ("No GPU utilization in this run (CPU-only hardware): each rank's process CPU use is shown "
                "instead, averaged between log steps")
    elif "cpu_percent" in per_metric:
        metric, label, what = "cpu_percent", "node CPU utilization (%)", "CPU utilization (no GPU)"
        note = "No GPU utilization in this run: node CPU utilization is shown instead"
    else:
        return _unavailable(path, title, "no system/node*/rank*/ utilization metrics were logged "
                            "(tracking.system_metrics off, or the run has not reached a log step).", h.name)
    import numpy as np

    cells = sorted(per_metric[metric])  # (node, rank): grouped by node, ranks ascending inside
    series = {c: h.series(per_metric[metric][c]) for c in cells}
    steps = sorted({s for ser in series.values() for s, _ in ser})
    col = {s: i for i, s in enumerate(steps)}
    grid = np.full((len(cells), len(steps)), np.nan)
    for r, c in enumerate(cells):
        for s, v in series[c]:
            grid[r, col[s]] = v
    # Cell edges half-way between logged steps, so irregular spacing (restarts) stays truthful.
    st = np.asarray(steps, dtype=float)
    if len(st) == 1:
        xedges = np.array([st[0] - 0.5, st[0] + 0.5])
    else:
        mids = (st[1:] + st[:-1]) / 2
        xedges = np.concatenate([[st[0] - (mids[0] - st[0])], mids, [st[-1] + (st[-1] - mids[-1])]])
    yedges = np.arange(len(cells) + 1) - 0.5
    fig = _figure(10.0, max(3.6, 1.4 + 0.32 * len(cells)))
    ax = fig.add_subplot(1, 1, 1)
    vmax = (100.0 if metric != "proc_cpu_percent"
            else max(100.0, float(np.nanmax(grid)) if np.isfinite(grid).any() else 100.0))
    mesh = ax.pcolormesh(xedges, yedges, np.ma.masked_invalid(grid), cmap="viridis", vmin=0.0, vmax=vmax,
                         shading="flat")
    cb = fig.colorbar(mesh, ax=ax, pad=0.02)
    cb.set_label(label)
    ax.set_yticks(range(len(cells)))
    ax.set_yticklabels([f"node{n} / rank{r}" for n, r in cells], fontsize=8 if len(cells) > 16 else 9)
    ax.invert_yaxis()
    prev = None
    for i, (n, _) in enumerate(cells):
        if prev is not None and n != prev:
            ax.axhline(i - 0.5, color="white", linewidth=2.5)
        prev = n
    _mark_restarts(ax, h.restarts(), text=True)
    ax.set_xlabel("training step")
    ax.set_ylabel("rank (grouped by node)")
    ax.set_title(f"{what} per rank over training, grouped by node", fontsize=12, pad=14)
    nodes = len({n for n, _ in cells})
    _note(fig, f"{note}. {len(cells)} ranks on {nodes} node(s); blank = rank absent (resize/restart). run: {h.name}",
          left=0.16, right=0.98, top=1 - 0.45 / fig.get_size_inches()[1])
    return _save(fig, path)


def chart_grad_sync(h: RunHistory, path: str) -> str:
    title = "Gradient-sync time fraction over training"
    ser = h.series("comm/grad_sync_fraction")
    if not ser:
        return _unavailable(path, title, "comm/grad_sync_fraction was not logged (no measured step yet, or the "
                            "gradient-sync timer is disabled).", h.name)
    steps = [s for s, _ in ser]
    vals = [100.0 * v for _, v in ser]
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(steps, vals, marker="o", markersize=3.5, linewidth=1.5, color="tab:blue", label="grad sync / step time")
    mean = sum(vals) / len(vals)
    ax.axhline(mean, color="tab:orange", linestyle="--", linewidth=1.2, label=f"mean {mean:.1f}%")
    _mark_restarts(ax, h.restarts())
    top = max(5.0, min(100.0, max(vals) * 1.2))
    ax.set_ylim(-0.03 * top, top)  # a flat 0 (dp=1) stays visible above the axis
    ax.set_xlabel("training step")
    ax.set_ylabel("time in gradient collectives (% of step)")
    ax.set_title(title, fontsize=12)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=9)
    extra = ""
    if max(vals) == 0:
        extra = " All zero: no gradient collective crossed ranks (data-parallel size 1)."
    _note(fig, "Measured on log steps: DeepSpeed's collectives timed with the device synchronised around each "
               f"(unoverlapped), divided by that step's wall time.{extra} run: {h.name}")
    return _save(fig, path)


def chart_compute_comm(h: RunHistory, path: str) -> str:
    title = "Compute / communication time ratio"
    ser = h.series("comm/grad_sync_fraction")
    if not ser:
        return _unavailable(path, title, "comm/grad_sync_fraction was not logged, so the compute/communication "
                            "split is unknown.", h.name)
    finite = [(s, (1 - f) / f) for s, f in ser if f > 0]
    zero_steps = [s for s, f in ser if f <= 0]
    if not finite:
        return _unavailable(path, title, "no gradient communication was measured (data-parallel size 1: "
                            "gradients never leave the rank), so the ratio is infinite: all compute.", h.name)
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    xs, ys = zip(*finite)
    ax.plot(xs, ys, marker="o", markersize=3.5, linewidth=1.5, color="tab:green", label="compute s per comm s")
    ax.axhline(1.0, color="0.4", linestyle="--", linewidth=1.0, label="compute = communication")
    if max(ys) / max(min(ys), 1e-9) > 20:
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, max(ys) * 1.2 + 0.1)
    _mark_restarts(ax, h.restarts())
    ax.set_xlabel("training step")
    ax.set_ylabel("(1 - f) / f")
    ax.set_title(title + " per step", fontsize=12)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="best", fontsize=9)
    note = ("f = comm/grad_sync_fraction (measured). Above 1: compute dominates; "
            "below 1: the step is communication-bound.")
    if zero_steps:
        note += f" {len(zero_steps)} step(s) with f = 0 (infinite ratio) not drawn."
    _note(fig, note + f" run: {h.name}")
    return _save(fig, path)


def chart_landscape(h: RunHistory, path: str, landscape: Optional[dict]) -> str:
    title = "Loss-landscape projection around the trained weights"
    if landscape is None:
        return _unavailable(path, title, "not computed yet: the projection is evaluated on validation batches "
                            "at the end of training (and when the charts are refreshed with it).", h.name)
    if landscape.get("unavailable"):
        return _unavailable(path, title, f"not available for this layout: {landscape['unavailable']}.", h.name)
    alphas = landscape.get("alphas") or []
    losses = landscape.get("losses") or []
    if not alphas or not losses:
        return _unavailable(path, title, "the landscape result holds no points.", h.name)
    import numpy as np

    two_d = bool(landscape.get("two_d")) and landscape.get("grid")
    fig = _figure(11.0 if two_d else 8.0, 4.8)
    ax = fig.add_subplot(1, 2 if two_d else 1, 1)
    ok = [(a, l) for a, l in zip(alphas, losses) if l is not None and math.isfinite(l)]
    if ok:
        xa, yl = zip(*ok)
        ax.plot(xa, yl, marker="o", markersize=4, linewidth=1.6, color="tab:purple", label="loss along direction 1")
    center = landscape.get("center_loss")
    if center is not None and math.isfinite(center):
        ax.scatter([0.0], [center], color="tab:red", zorder=5, s=40, label=f"trained weights ({center:.3f})")
    ax.set_xlabel("step along filter-normalised direction (alpha)")
    ax.set_ylabel("validation loss")
    ax.set_title("1-D slice", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=9)
    if two_d:
        ax2 = fig.add_subplot(1, 2, 2)
        grid = np.array([[np.nan if v is None else v for v in row] for row in landscape["grid"]], dtype=float)
        A, B = np.meshgrid(np.asarray(alphas, float), np.asarray(landscape["betas"], float))
        finite = grid[np.isfinite(grid)]
        if finite.size:
            levels = np.linspace(finite.min(), np.percentile(finite, 95), 15)
            if np.ptp(levels) <= 0:
                levels = 15
            cs = ax2.contourf(A, B, np.clip(grid, None, finite.max()), levels=levels, cmap="magma_r", extend="max")
            ax2.contour(A, B, grid, levels=levels if not isinstance(levels, int) else 8, colors="k",
                        linewidths=0.4, alpha=0.5)
            cb = fig.colorbar(cs, ax=ax2, pad=0.02, format="%.4g")
            cb.set_label("validation loss")
        ax2.plot([0], [0], marker="*", color="cyan", markersize=12, markeredgecolor="k", label="trained weights")
        ax2.set_xlabel("alpha (direction 1)")
        ax2.set_ylabel("beta (direction 2)")
        ax2.set_title("2-D projection", fontsize=11)
        ax2.legend(loc="upper right", fontsize=8)
    fig.suptitle(title, fontsize=12, fontweight="bold")
    _note(fig, f"Li et al. 2018: random Gaussian directions, each row rescaled to the norm of the weight row; "
               f"1-D params fixed. seed {landscape.get('seed')}, {landscape.get('num_batches')} validation "
               f"batch(es), span +/-{landscape.get('span')}. A smooth bowl is healthy; a cliff or a flat "
               f"line at the centre hints at a broken layout. run: {h.name}", top=0.86, wspace=0.3)
    return _save(fig, path)


def chart_fragmentation(h: RunHistory, path: str) -> str:
    title = "Memory fragmentation index over training"
    ser = h.series("memory/fragmentation")
    per_rank = []
    for k in h.keys:
        m = _SYS.match(k)
        if m and m.group(3) == "gpu_mem_fragmentation":
            per_rank.append((int(m.group(1)), int(m.group(2)), k))
    if not ser and not per_rank:
        return _unavailable(path, title, _no_gpu_reason(h, "The fragmentation index (inactive split / reserved bytes)"),
                            h.name)
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    for i, (n, r, k) in enumerate(sorted(per_rank)):
        rs = h.series(k)
        if rs:
            ax.plot([s for s, _ in rs], [v for _, v in rs], linewidth=0.8, alpha=0.45,
                    label="per rank" if i == 0 else None, color="0.5")
    if ser:
        ax.plot([s for s, _ in ser], [v for _, v in ser], marker="o", markersize=3.5, linewidth=1.8,
                color="tab:red", label="worst rank (memory/fragmentation)")
    _mark_restarts(ax, h.restarts())
    ax.set_ylim(0, 1)
    ax.set_xlabel("training step")
    ax.set_ylabel("inactive split bytes / reserved bytes")
    ax.set_title(title, fontsize=12)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=9)
    peak = h.series("memory/peak_allocated_gib")
    extra = f" Peak allocated {max(v for _, v in peak):.2f} GiB." if peak else ""
    _note(fig, "Share of the CUDA caching allocator's reserved memory stranded in free pieces of split blocks still "
               "partly in use (torch.cuda.memory_stats inactive_split_bytes / reserved_bytes): only tensors smaller "
               "than each piece can use it. Whole cached blocks are not counted (a new tensor reuses them). High "
               "values before an OOM point at fragmentation (remedy: "
               f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True).{extra} run: {h.name}")
    return _save(fig, path)


# ------------------------------------------------------------------------------------------- entry points
def render_charts(tracking_uri: str, run_id: str, out_dir: str, landscape: Optional[dict] = None,
                  reuse_logged_landscape: bool = True) -> list[str]:
    """Write the five PNGs (CHART_FILES) into out_dir from the run's metric history; returns their paths.

    landscape: loss_landscape()'s result; None reuses the one logged by an earlier render (charts/
    loss_landscape.json), else the chart says it is not computed yet. A given landscape is also written
    as out_dir/loss_landscape.json so later refreshes keep it. Each chart fails alone: an error in one
    becomes an image saying so. Raises only if the run cannot be read at all (server away): callers on
    the training path should use ChartPublisher, which never raises.
    """
    os.makedirs(out_dir, exist_ok=True)
    client = mlflow_client(tracking_uri)
    h = RunHistory(client, run_id)
    if landscape is None and reuse_logged_landscape:
        landscape = previous_landscape(client, run_id)
    if landscape is not None:
        try:
            with open(os.path.join(out_dir, LANDSCAPE_JSON), "w") as fh:
                json.dump(landscape, fh, indent=1, default=str)
        except Exception:
            pass
    jobs = [
        ("utilization_heatmap.png", "Utilization heatmap", lambda p: chart_utilization(h, p)),
        ("grad_sync_fraction.png", "Gradient-sync time fraction", lambda p: chart_grad_sync(h, p)),
        ("compute_comm_ratio.png", "Compute / communication time ratio", lambda p: chart_compute_comm(h, p)),
        ("loss_landscape.png", "Loss-landscape projection", lambda p: chart_landscape(h, p, landscape)),
        ("memory_fragmentation.png", "Memory fragmentation index", lambda p: chart_fragmentation(h, p)),
    ]
    paths = []
    for name, title, fn in jobs:
        path = os.path.join(out_dir, name)
        try:
            paths.append(fn(path))
        except Exception as e:
            log.warning("chart %s failed (%s); writing a placeholder", name, e)
            paths.append(_unavailable(path, title, f"rendering failed: {type(e).__name__}: {e}", h.name))
    return paths


class ChartPublisher:
    """Renders and logs the charts off the training thread: flush the queued metrics (bounded wait),
    render from the run's history, queue the PNGs as the run's charts/ artifacts.

        pub = ChartPublisher(tracker, tracking_uri, run_id)
        pub.publish()                             # every N checkpoints: returns at once
        pub.publish(landscape=res, wait_s=120)    # at the end: waits at most wait_s
    A refresh already in flight makes the next publish() a no-op (returns False). Never raises.
    """

    def __init__(self, tracker: Any, tracking_uri: str, run_id: str, flush_timeout_s: float = 60.0):
        self.tracker, self.uri, self.run_id = tracker, tracking_uri, run_id
        self.flush_timeout_s = flush_timeout_s
        self._thread: Optional[threading.Thread] = None
        self._warned = False
        self.last_paths: list[str] = []

    def publish(self, landscape: Optional[dict] = None, wait_s: float = 0.0) -> bool:
        try:
            if self._thread is not None and self._thread.is_alive():
                if wait_s > 0:
                    self._thread.join(wait_s)
                if self._thread.is_alive():
                    return False
            self._thread = threading.Thread(target=self._run, args=(landscape,), name="rayspeed-charts", daemon=True)
            self._thread.start()
            if wait_s > 0:
                self._thread.join(wait_s)
            return True
        except Exception as e:
            self._warn(e)
            return False

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self, landscape: Optional[dict]) -> None:
        try:
            if self.tracker is not None:
                self.tracker.deliver(self.flush_timeout_s)
            # The folder only carries the files to MLflow (the logger deletes it once sent; the next publisher on
            # this host deletes it if this process is killed first).
            out = owned_scratch("rayspeed-charts-")
            try:
                paths = render_charts(self.uri, self.run_id, out, landscape=landscape)
                self.last_paths = [os.path.basename(p) for p in paths]
            except BaseException:
                shutil.rmtree(out, ignore_errors=True)
                raise
            if self.tracker is not None:
                self.tracker.log_artifact_dir(out, "charts", remove=True)
            else:
                shutil.rmtree(out, ignore_errors=True)
        except Exception as e:
            self._warn(e)

    def _warn(self, e: Exception) -> None:
        if not self._warned:
            log.warning("charts not refreshed (%s); training continues, will retry at the next refresh", str(e)[:200])
            self._warned = True
