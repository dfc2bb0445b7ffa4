"""How a mixture of experts routes, in MLflow: at every log step moe/aux_loss, moe/load_imbalance (the worst MoE
layer's max over mean tokens per expert), moe/load_imbalance_layer (which layer that is) and moe/dropped_tokens,
over the window's training forwards of every data-parallel rank; every tracking.charts_every_checkpoints
checkpoints (the dashboard charts' cadence) and at the end, the tokens each expert of each layer took since the
last such file, as moe/expert_load/step_<N>.json and a heatmap beside it (a few thousand numbers per file rather
than thousands of metric keys).

    load = ExpertLoad(model.router_stats, moe_layers, groups, device, tracker, every=5)
    metrics.sources.append(load.metrics)      # rayspeed.train.metrics_callback: one dict per log step
    events.add(load)                          # the artifacts
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

from rayspeed.paths import owned_scratch
from rayspeed.train.events import Callback, TrainState

log = logging.getLogger("rayspeed.worker")

ARTIFACT_DIR = "moe/expert_load"


def imbalance(counts: torch.Tensor) -> tuple[float, int]:
    """(max over mean tokens per expert of the worst layer, that layer's row) of counts [layers, experts]; 1.0 is
    a perfectly even split, experts (the number) is every token of a layer on one expert."""
    per_layer = counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-12)
    worst = int(torch.argmax(per_layer))
    return float(per_layer[worst]), worst


class ExpertLoad(Callback):
    """Under a pipeline (`rows`, `pooled`), each stage's stats hold its MoE layers only: `rows` are their places in
    moe_layers, `pooled` the last stage's loss function, which adds up the balance loss pooled over every stage
    (model.stage_loss.PipelineLoss); the counts and that sum are then added up over the pipeline group too."""

    def __init__(self, stats: Any, moe_layers: list[int], groups: Any, device: torch.device, tracker: Any,
                 every: int = 0, rows: Optional[list[int]] = None, pooled: Any = None):
        self.stats, self.moe_layers, self.groups, self.device, self.tracker = stats, moe_layers, groups, device, tracker
        self.rows, self.pooled = rows, pooled
        self.every, self.checkpoints = every, 0
        self.since: Optional[torch.Tensor] = None  # reduced counts since the last artifact
        self.since_step = 0
        self.through_step = 0

    def metrics(self, state: TrainState) -> dict[str, float]:
        """The window's routing over every data-parallel rank (a collective: every rank calls it)."""
        w = self.stats.window.take()
        aux, forwards = float(w.aux), float(w.forwards)
        if self.pooled is not None:  # a pipeline: the last stage's loss pooled every stage's routing
            aux, forwards = float(self.pooled.aux_sum), float(self.pooled.aux_forwards)
            self.pooled.aux_sum, self.pooled.aux_forwards = 0.0, 0
            counts = torch.zeros(len(self.moe_layers), self.stats.num_experts, dtype=torch.float64)
            if w.counts is not None:
                counts[self.rows] = w.counts.double().cpu()
        elif w.counts is None:  # no training forward since the last log (cannot happen inside a run's loop)
            return {}
        else:
            counts = w.counts.double().cpu()
        flat = torch.cat([counts.reshape(-1), torch.tensor([aux, forwards, float(w.dropped)], dtype=torch.float64)])
        flat = flat.to(self.device)
        for group in (getattr(self.groups, "dpcp_group", None),
                      getattr(self.groups, "pp_group", None) if self.pooled is not None else None):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(flat, group=group)
        counts = flat[:-3].view_as(counts).cpu()
        aux, forwards, dropped = (float(v) for v in flat[-3:])
        self.since = counts if self.since is None else self.since + counts
        self.through_step = state.step
        worst, row = imbalance(counts)
        return {"moe/aux_loss": aux / max(1.0, forwards), "moe/load_imbalance": worst,
                "moe/load_imbalance_layer": float(self.moe_layers[row]), "moe/dropped_tokens": dropped}

    def on_checkpoint_saved(self, state: TrainState, stall_s: float) -> None:
        self.checkpoints += 1
        if self.every and self.checkpoints % self.every == 0:
            self.publish(state)

    def on_end(self, state: TrainState) -> None:
        self.publish(state)

    def publish(self, state: TrainState) -> None:
        if self.since is None or self.through_step <= self.since_step:
            return
        counts, first, last = self.since, self.since_step + 1, self.through_step
        self.since, self.since_step = None, last
        if not state.is_rank0:
            return
        record = {"steps": [first, last], "layers": self.moe_layers,
                  "tokens_per_expert": [[int(v) for v in row] for row in counts.round().long().tolist()]}
        folder = owned_scratch("rayspeed-expert-load-")
        try:
            name = os.path.join(folder, f"step_{last:07d}")
            with open(name + ".json", "w") as f:
                json.dump(record, f)
            heatmap(counts, self.moe_layers, (first, last), name + ".png")
            self.tracker.log_artifact_dir(folder, ARTIFACT_DIR, remove=True)
        except Exception as e:  # a chart is not worth a training run
            log.warning("expert load artifact for steps %d..%d not written: %s", first, last, e)
            shutil.rmtree(folder, ignore_errors=True)


def heatmap(counts: torch.Tensor, layers: list[int], steps: tuple[int, int], path: str) -> None:
    """Each expert's share of its layer's tokens over the even share (1.0: balanced), layers down, experts across."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    share = (counts / counts.mean(dim=1, keepdim=True).clamp(min=1e-12)).numpy()
    fig = Figure(figsize=(min(16.0, 3 + 0.12 * counts.shape[1]), min(12.0, 2 + 0.25 * len(layers))), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
    if len(layers) <= 48:
        ax.set_yticks(range(len(layers)), [str(i) for i in layers])
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(f"tokens per expert / even share, steps {steps[0]}..{steps[1]}")
    fig.colorbar(image, ax=ax)
    fig.savefig(path)
