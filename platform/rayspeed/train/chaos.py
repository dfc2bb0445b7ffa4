"""Fault-injection drills (`chaos.*` job keys): a rank dies or hangs once, at a given step or inside a checkpoint
write, its loss is NaN once, or its step runs out of memory (once, or in every attempt). Each once-drill fires once
per job: its marker lives in the experiment's storage, since the restarted rank may run on another node."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from rayspeed import paths, storage
from rayspeed.config.job_checks import chaos_drills

log = logging.getLogger("rayspeed.chaos")

# Where a checkpoint save can be interrupted, in order: before any shard, between this rank's DeepSpeed shards and
# its RNG shard, after this rank's shards are durable (uploaded on an object store), after every rank's shards are
# durable but before the manifest (a rank other than 0 in an async save: before it reports its part), after the
# manifest committed. In an async save every point after before_shards is in the background writer.
CHECKPOINT_POINTS = ("before_shards", "between_shards", "after_shards", "before_manifest", "after_manifest")
DEFAULT_POINT = "before_manifest"


class ChaosDrills:
    def __init__(self, chaos_cfg: Any, rank: int, experiment_dir: str):
        self.cfg, self.rank = chaos_cfg, rank
        self.exp = storage.locate(experiment_dir)

    def _once(self, kind: str, spec: Any, step: int) -> bool:
        if spec is None or spec.rank != self.rank or spec.step != step:
            return False
        marker = paths.chaos_marker(kind, spec.rank, spec.step)
        if self.exp.exists(marker):
            return False
        self.exp.write_bytes(marker, str(time.time()).encode())
        return True

    @staticmethod
    def _die(why: str) -> None:
        log.warning("chaos: %s", why)
        for h in logging.getLogger("rayspeed").handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def at_step(self, step: int) -> None:
        oom = self.cfg.oom_at_step
        if oom is not None and (self._once("oom", oom, step) if oom.attempts != "all"
                                else (oom.rank, oom.step) == (self.rank, step)):
            import torch

            log.warning("chaos: rank %d runs out of memory at step %d", self.rank, step)
            # CUDA's own wording, so the error takes the path a real one does (rayspeed.train.oom).
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 20.00 MiB. (chaos.oom_at_step: "
                                         f"rank {self.rank} at step {step})")
        if self._once("kill", self.cfg.kill_rank_at_step, step):
            self._die(f"killing rank {self.rank} at step {step}")
        if self._once("hang", self.cfg.hang_rank_at_step, step):
            log.warning("chaos: rank %d hangs at step %d", self.rank, step)
            while True:  # the others' collectives time out; Ray then restarts the group
                time.sleep(3600)

    def poisons_loss(self, step: int) -> bool:
        """chaos.nan_loss_at_step: this rank's loss of this step is NaN (once per job; the watchdog's drill)."""
        if self._once("nan", self.cfg.nan_loss_at_step, step):
            log.warning("chaos: rank %d's loss is NaN at step %d", self.rank, step)
            return True
        return False

    def in_checkpoint(self, step: int, point: str) -> None:
        """Called at each point of a save (CHECKPOINT_POINTS, in order); dies at the drill's point."""
        for spec in chaos_drills(self.cfg.kill_rank_in_checkpoint):
            if (spec.point or DEFAULT_POINT) == point and self._once("ckptkill", spec, step):
                self._die(f"killing rank {self.rank} inside the checkpoint write of step {step} ({point})")
