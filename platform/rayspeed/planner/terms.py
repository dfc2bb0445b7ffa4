"""Where a feature adds what it costs: memory per rank and time per step, each term a function with its source,
registered here instead of edited into memory.py or timing.py. Adapters (their weights, gradients and optimizer
state beside a frozen base), context parallelism (attention over a split sequence, its all-to-all or ring
exchange), expert parallelism (dispatch and combine) and DPO (the reference model's pass, two sequences per
example) each add their terms in their own module and register them:

    register(MemoryTerm("adapter_states", applies=lambda ctx, lay: ..., bytes=..., source="docs/PLANNER.md ..."))
    register(TimeTerm("cp_exchange_s", applies=..., seconds=..., kind="communication", source="..."))

A memory term is one more component of the breakdown (`dynamic`: it churns like activations, so it widens the
allocator's slack); a time term one more part of the step (`kind` says which of compute, communication or overhead
the calibrated efficiency factors scale it with). Both appear in `rayspeed plan --explain` under their names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

Applies = Callable[[Any, Any], bool]  # (Ctx, Layout) -> whether the term concerns this job and layout
TIME_KINDS = ("compute", "communication", "overhead")


@dataclass(frozen=True)
class MemoryTerm:
    component: str
    applies: Applies
    bytes: Callable[[Any, Any, int], float]
    """(Ctx, Layout, pipeline stage) -> bytes on one rank of that stage."""
    source: str
    """Where the formula comes from (a docs/PLANNER.md section, a paper, a measurement)."""
    dynamic: bool = True


@dataclass(frozen=True)
class TimeTerm:
    name: str
    applies: Applies
    seconds: Callable[[Any, Any], float]
    """(Ctx, Layout) -> seconds per optimizer step on the critical path."""
    source: str
    kind: str = "compute"

    def __post_init__(self) -> None:
        if self.kind not in TIME_KINDS:
            raise ValueError(f"TimeTerm {self.name}: kind must be one of {TIME_KINDS}, got {self.kind!r}")


MEMORY_TERMS: list[MemoryTerm] = []
TIME_TERMS: list[TimeTerm] = []


def register(term: MemoryTerm | TimeTerm) -> None:
    """Add a term (once per name: a module imported twice does not count it twice)."""
    terms: list[Any] = MEMORY_TERMS if isinstance(term, MemoryTerm) else TIME_TERMS
    key = term.component if isinstance(term, MemoryTerm) else term.name
    terms[:] = [t for t in terms if (t.component if isinstance(t, MemoryTerm) else t.name) != key] + [term]


def unregister(name: str) -> None:
    MEMORY_TERMS[:] = [t for t in MEMORY_TERMS if t.component != name]
    TIME_TERMS[:] = [t for t in TIME_TERMS if t.name != name]


def memory_terms(ctx: Any, lay: Any, stage: int) -> dict[str, tuple[float, bool]]:
    """{component: (bytes, dynamic)} of every registered term that applies."""
    return {t.component: (float(t.bytes(ctx, lay, stage)), t.dynamic) for t in MEMORY_TERMS if t.applies(ctx, lay)}


def time_terms(ctx: Any, lay: Any) -> dict[str, tuple[float, str]]:
    """{name: (seconds, kind)} of every registered term that applies."""
    return {t.name: (float(t.seconds(ctx, lay)), t.kind) for t in TIME_TERMS if t.applies(ctx, lay)}
