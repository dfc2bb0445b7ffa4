"""The chaos.* keys: fault-injection drills for the resilience paths (rayspeed.train.chaos), off unless set."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union


@dataclass
class KillAt:
    rank: int = 0
    """Rank whose process dies."""
    step: int = 1
    """Step at which it dies (once per job)."""
    point: Optional[Literal["before_shards", "between_shards", "after_shards", "before_manifest",
                            "after_manifest"]] = None
    """Only for chaos.kill_rank_in_checkpoint: where in the save it dies (null: before_manifest, i.e. after its
    shards are durable and before the manifest commits)."""


@dataclass
class OomAt:
    rank: int = 0
    """Rank whose step runs out of memory."""
    step: int = 1
    """Step at which it does."""
    attempts: Union[Literal[1], Literal["all"]] = 1
    """1: once per submission; all: in every attempt that reaches the step, whatever the layout (the give-up drill)."""


@dataclass
class ChaosConfig:
    kill_rank_at_step: Optional[KillAt] = None
    """{rank: 1, step: 12}: that rank's process dies once, at that step."""
    kill_rank_in_checkpoint: Union[KillAt, list[KillAt], None] = None
    """{rank: 0, step: 10, point: before_manifest}: that rank dies once while writing the checkpoint of that step,
    at `point` (before_shards | between_shards | after_shards | before_manifest | after_manifest): the drill for
    torn checkpoints. With resilience.checkpoint_mode async every point after before_shards is in the background
    writer, while training goes on. A list of them (distinct steps): one kill each, the restarts in turn (raise
    resilience.max_failures to their number)."""
    hang_rank_at_step: Optional[KillAt] = None
    """{rank: 1, step: 12}: that rank stops answering once, at that step (the others' collectives must time
    out after resilience.collective_timeout_s and the job restart)."""
    nan_loss_at_step: Optional[KillAt] = None
    """{rank: 0, step: 5}: that rank's loss is NaN once, at that step (the drill for health.watchdog: skip withholds
    the update, rollback restores the last verified checkpoint, off lets it through). With a pipeline, name a rank
    of the last stage (where the loss is computed)."""
    oom_at_step: Optional[OomAt] = None
    """{rank: 0, step: 3}: that rank's step raises torch.OutOfMemoryError as CUDA does (the drill for
    resilience.oom_replans); attempts: all raises it in every attempt."""
