"""What a step that ran out of device memory teaches the planner (rayspeed.train.oom records it; torch-free).

The layout that failed is refused. The memory model was wrong for it by at least (measured need - predicted), where
the need is a lower bound (the allocator's peak reserved bytes plus the allocation that failed). Model state is
exact (tests: planner bytes = engine bytes), so the shortfall is put on what grows with the micro-batch (activations
and the logits' loss): every layout of the same kind (tp, pp, cp, ep, ZeRO stage, recomputation, sequence
parallelism) gets it added in proportion to its own per-micro-batch bytes. A correction only ever adds memory: a
measurement never lowers another layout's prediction.

    feedback = OomFeedback.of(records)          # this submission's records (rayspeed.train.oom)
    feedback.refused(layout)                    # the measurement that refuses it, or None
    feedback.extra_bytes(layout, memory)        # bytes added to its prediction
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rayspeed.config.layout import RECORD_DEFAULTS

PER_MICRO_BATCH = ("activations", "logits_loss")
KIND = ("tp", "pp", "cp", "ep", "zero_stage", "activation_checkpointing", "sequence_parallel")
SAME = ("dp", *KIND, "micro_batch_size")


def _key(layout: Any, names: tuple[str, ...]) -> tuple:
    get = layout.get if isinstance(layout, dict) else (lambda k, d=None: getattr(layout, k, d))
    defaults = {**RECORD_DEFAULTS, "activation_checkpointing": "none", "sequence_parallel": False}
    return tuple(get(k, defaults.get(k)) for k in names)


@dataclass(frozen=True)
class MeasuredOom:
    layout: dict
    """The failing layout (rayspeed.config.layout.Layout.record())."""
    need_bytes: int
    """Peak reserved + the failed allocation on the rank that failed: a lower bound of what the step needs."""
    predicted_bytes: int
    """The planner's total for that layout's worst rank when it was chosen."""
    per_micro_batch_bytes: int
    """Of which activations and the logits' loss (what grows with the micro-batch)."""
    step: int
    rank: int

    @classmethod
    def of(cls, record: dict) -> "MeasuredOom":
        return cls(layout=dict(record["layout"]), need_bytes=int(record.get("need_bytes") or 0),
                   predicted_bytes=int(record.get("predicted_bytes") or 0),
                   per_micro_batch_bytes=int(record.get("per_micro_batch_bytes") or 0),
                   step=int(record.get("step") or 0), rank=int(record.get("rank") or 0))

    @property
    def shortfall_bytes(self) -> int:
        return max(0, self.need_bytes - self.predicted_bytes)


@dataclass(frozen=True)
class OomFeedback:
    measured: tuple[MeasuredOom, ...] = ()

    @classmethod
    def of(cls, records: list[dict]) -> "OomFeedback":
        return cls(tuple(MeasuredOom.of(r) for r in records))

    def __bool__(self) -> bool:
        return bool(self.measured)

    def refused(self, layout: Any) -> Optional[MeasuredOom]:
        """The measurement that refuses this exact layout (None: not tried)."""
        key = _key(layout, SAME)
        return next((m for m in self.measured if _key(m.layout, SAME) == key), None)

    def extra_bytes(self, layout: Any, memory: dict) -> int:
        """What the measurements add to this layout's prediction (0 for a layout of another kind)."""
        mine = sum(int(memory.get(k, 0)) for k in PER_MICRO_BATCH)
        kind = _key(layout, KIND)
        extra = 0
        for m in self.measured:
            if _key(m.layout, KIND) == kind and m.shortfall_bytes and m.per_micro_batch_bytes:
                extra = max(extra, int(m.shortfall_bytes * mine / m.per_micro_batch_bytes))
        return extra
