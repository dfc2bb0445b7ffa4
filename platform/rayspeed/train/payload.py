"""What crosses the launcher -> worker boundary and back: the launch payload (pickled by Ray into every
worker) and the run result (rank 0 writes it to the experiment directory; the launcher reads it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class LaunchPayload:
    job: dict[str, Any]
    """The user's job as parsed (its "auto"s intact): every worker re-plans it for the world it got."""
    tracking_uri: str
    """The MLflow store the run lives in."""
    storage_path: str
    """storage.path resolved (local absolute path or object-store URI)."""
    experiment_dir: str
    """<storage>/<job name>: checkpoints, events, summary."""
    launched_at: float
    """Wall-clock time the command started (its process: the interpreter counts)."""
    mlflow_run_id: Optional[str] = None
    """The job's one MLflow run (None: tracking unavailable, training goes on)."""
    tracking_deferred: bool = False
    """The tracking server did not answer at launch: rank 0 finds or creates the job's run once it does."""
    resume: str = "auto"
    """auto | fresh | anyway: what the launcher decided about an existing checkpoint's config (--fresh,
    --resume-anyway)."""
    run_identity: Optional[dict[str, Any]] = None
    """What the run computes, as submitted (rayspeed.train.resume_guard.run_identity), computed once by the
    launcher: every checkpoint records it (None: the worker computes it from `job`)."""
    start_phases: dict[str, float] = field(default_factory=dict)
    """The launcher's part of the start, phase by phase (rayspeed.train.timeline)."""
    handed_at: Optional[float] = None
    """When the launcher handed the job to the workers (Ray Train's fit, or the in-process loop)."""


@dataclass
class RunResult:
    status: str
    """finished | preflight_failed | a FinalError's status (reward_failed)."""
    steps: int = 0
    final_loss: Optional[float] = None
    val_loss: Optional[float] = None
    restarts: int = 0
    world_size: Optional[int] = None
    global_batch_size: Optional[int] = None
    recovery_s: Optional[float] = None
    checkpoint_stall_s: Optional[float] = None
    """Median time training was blocked by a checkpoint save."""
    checkpoint_write_s: Optional[float] = None
    """Median time a save's write took: an async save's background part (snapshot written, durable, committed),
    a sync save's whole stall."""
    checkpoint_bytes: Optional[int] = None
    """Bytes of the newest checkpoint, every rank's files together."""
    model_state_bytes: Optional[dict[str, int]] = None
    layout: Optional[dict[str, Any]] = None
    registered_model_version: Optional[str] = None
    mlflow_run_id: Optional[str] = None
    """The run rank 0 logged to (the launcher's, or the one it created when the server came back)."""
    error: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self, name: str, launcher: str, **overrides: Any) -> dict[str, Any]:
        """summary.json: every field of the result (but `error`, which the launcher words, and `extra`), with the
        job's name and the launcher."""
        fields = {k: v for k, v in self.to_json().items() if k not in ("error", "extra")}
        return {"name": name, **fields, **overrides, "launcher": launcher}

    @classmethod
    def from_json(cls, d: Optional[dict[str, Any]]) -> "RunResult":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known}) if d else cls(status="unknown")
