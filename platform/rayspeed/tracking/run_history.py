"""One run's recorded history as the charts read it: metric series (a step replayed after a restart keeps its latest
value), params, tags, restarts, and the loss landscape an earlier render logged."""

from __future__ import annotations

import json
import tempfile
from typing import Any, Optional

LANDSCAPE_JSON = "loss_landscape.json"


class RunHistory:
    """The metric histories of one run (fetched once per key) plus its params."""

    def __init__(self, client: Any, run_id: str):
        self.client, self.run_id = client, run_id
        run = client.get_run(run_id)
        self.params: dict[str, str] = dict(run.data.params)
        self.tags: dict[str, str] = dict(run.data.tags)
        self.keys: list[str] = sorted(run.data.metrics)
        self.name = run.info.run_name or run_id
        self._cache: dict[str, list[tuple[int, float]]] = {}

    def series(self, key: str) -> list[tuple[int, float]]:
        """[(step, value)] sorted by step; a step logged twice (a restart replaying it) keeps the latest."""
        if key not in self._cache:
            if key not in self.keys:
                self._cache[key] = []
            else:
                by_step: dict[int, tuple[int, float]] = {}
                for m in self.client.get_metric_history(self.run_id, key):
                    prev = by_step.get(m.step)
                    if prev is None or m.timestamp >= prev[0]:
                        by_step[m.step] = (m.timestamp, m.value)
                self._cache[key] = sorted((s, v) for s, (_, v) in by_step.items())
        return self._cache[key]

    def restarts(self) -> list[int]:
        """Steps at which the run restarted (resilience/restarts went up)."""
        out, prev = [], None
        for step, v in self.series("resilience/restarts"):
            if prev is not None and v > prev:
                out.append(step)
            prev = v
        return out

    def on_gpu(self) -> Optional[bool]:
        v = self.params.get("cluster.use_gpu")
        return None if v is None else v.lower() == "true"


def previous_landscape(client: Any, run_id: str) -> Optional[dict]:
    """The landscape a previous render logged next to the charts (charts/loss_landscape.json), if any."""
    try:
        names = {a.path for a in client.list_artifacts(run_id, "charts")}
        if f"charts/{LANDSCAPE_JSON}" not in names:
            return None
        with tempfile.TemporaryDirectory(prefix="rayspeed-landscape-") as d:
            p = client.download_artifacts(run_id, f"charts/{LANDSCAPE_JSON}", d)
            with open(p) as fh:
                return json.load(fh)
    except Exception:
        return None
