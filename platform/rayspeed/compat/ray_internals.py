"""Ray Train v2 internals rayspeed uses (written for ray 2.60.0); each says why and when it can go."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

log = logging.getLogger("rayspeed.compat")


def controller_callback_bases() -> tuple[type, type]:
    """(ControllerCallback, WorkerGroupCallback): Ray Train v2's callback interfaces (under `_internal` in 2.60),
    which rayspeed's ResilienceCallback implements to timestamp failures and resize decisions."""
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

    return ControllerCallback, WorkerGroupCallback


def count_live_workers_only() -> None:
    """Make Ray Train's elastic sizing count only nodes that are alive.

    After a node dies, the autoscaling coordinator's reservations still list it for a while, so the elastic
    policy retries the old size and waits out the whole worker-group start timeout for capacity that is gone
    (64 s measured). Filtering the reservations by the GCS's live-node table makes the first restart decision use
    the world that actually exists. Patches `ElasticScalingPolicy._count_possible_workers` (ray 2.60.0); applied
    once, in the controller process."""
    from ray.train.v2._internal.execution.scaling_policy import elastic

    policy = elastic.ElasticScalingPolicy
    if getattr(policy._count_possible_workers, "_rayspeed_live_only", False):
        return
    original = policy._count_possible_workers

    def _count(self, reserved_resources):
        try:
            import ray

            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            live = {k: v for k, v in reserved_resources.items() if k in alive}
            if len(live) != len(reserved_resources):
                log.warning("rayspeed: ignoring reservations on %d dead node(s) when sizing the worker group",
                            len(reserved_resources) - len(live))
            reserved_resources = live
        except Exception as e:  # fall back to Ray's own view
            log.warning("rayspeed: could not read live nodes (%s); using Ray's reservations", e)
        return original(self, reserved_resources)

    _count._rayspeed_live_only = True  # type: ignore[attr-defined]
    policy._count_possible_workers = _count


def fail_after_capacity_wait(wait_s: float, message: str) -> None:
    """A (re)start that finds fewer workers than the minimum waits in Ray Train's elastic policy forever (it returns
    NoopDecision every poll). Patches `ElasticScalingPolicy.make_decision_for_non_running_worker_group` (ray
    2.60.0) to log once when the wait begins and to raise RuntimeError(message) after wait_s: the controller turns
    it into the run's failure. Applied once, in the controller process."""
    import time

    from ray.train.v2._internal.execution.scaling_policy import elastic

    policy = elastic.ElasticScalingPolicy
    if getattr(policy.make_decision_for_non_running_worker_group, "_rayspeed_capacity", False):
        return
    original = policy.make_decision_for_non_running_worker_group

    def _decide(self):
        decision = original(self)
        if type(decision).__name__ != "NoopDecision":
            self._rayspeed_waiting_since = None
            return decision
        since = getattr(self, "_rayspeed_waiting_since", None)
        now = time.monotonic()
        if since is None:
            self._rayspeed_waiting_since = now
            log.warning("rayspeed: waiting for capacity: fewer than %d workers can start; failing after %.0f s",
                        self.scaling_config.min_workers, wait_s)
        elif now - since > wait_s:
            raise RuntimeError(message)
        return decision

    _decide._rayspeed_capacity = True  # type: ignore[attr-defined]
    policy.make_decision_for_non_running_worker_group = _decide


def lean_trainer_class(embedded: bool, on_controller: Optional[Callable[[Callable[[], None]], None]] = None) -> Any:
    """TorchTrainer without DatasetsCallback (no Ray Dataset: a DatasetManager actor per attempt) and without
    PlacementGroupCleanerCallback. Why the cleaner goes: it is a detached actor (a process: 2.1 s of CPU at every
    start on the 2-core demo, docs/BENCHMARKS.md "What a start costs") that removes the run's placement group if
    the controller dies while the driver lives on. Ray keeps such a group while the driver lives, but the launcher's
    fit() fails when the controller dies and its process exits, and Ray removes an ended job's placement groups
    (they are not detached; tests/train/test_launch_embedded.py kills a controller). On the cluster the launcher
    starts for itself it also found any other Ray instance on the machine, died, and the controller waited ~20 s for
    it at every attempt (the seeded kill drill of make test-slow: 191 s without it, 272 s with). Built in
    `TorchTrainer._create_default_callbacks` (2.60.0). Remove when Ray Train skips both. A fixed-size job's
    controller also gets a scaling policy without the autoscaling coordinator (rayspeed.compat.ray_backend says
    why), through `_initialize_and_run_controller`'s keyword arguments (2.60.0).

    on_controller(abort): called instead of Ray Train's own SIGINT handler, which aborts the run and then exits the
    process past the caller (exit 1, no word said); `abort()` stops the run as that handler would
    (`TrainController.abort`, 2.60.0). The launcher's own handler calls it (rayspeed.train.interrupt)."""
    import ray
    from ray.train.torch import TorchTrainer

    skip = {"DatasetsCallback", "PlacementGroupCleanerCallback"}

    class RayspeedTrainer(TorchTrainer):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            return callbacks if self.datasets else [cb for cb in callbacks if type(cb).__name__ not in skip]

        def _initialize_and_run_controller(self, **kwargs):
            from rayspeed.compat.ray_backend import FixedWithoutCoordinator

            if type(kwargs["scaling_policy"]).__name__ == "FixedScalingPolicy":
                kwargs["scaling_policy"] = FixedWithoutCoordinator(self.scaling_config)
            return super()._initialize_and_run_controller(**kwargs)

        def _register_sigint_handler(self, controller):
            if on_controller is None:
                return super()._register_sigint_handler(controller)
            on_controller(lambda: ray.get(controller.abort.remote()))

    return RayspeedTrainer


def set_worker_group_start_timeout(seconds: float) -> None:
    """How long Ray Train's controller waits for a worker group to start before calling the attempt failed.

    Why: after a node loss it first retries the old size, so its default 60 s is pure recovery delay; Ray Train
    v2 reads it only from the environment variable RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (ray 2.60.0, no
    ScalingConfig/RunConfig field). Remove when Ray Train takes it as a config field. An operator's own setting
    wins."""
    import os

    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", str(seconds))


RUN_SNAPSHOT = "checkpoint_manager_snapshot.json"


def forget_reported_checkpoints(exp: Any) -> bool:
    """Delete Ray Train's checkpoint-manager snapshot in the experiment folder (a storage Location); True when there
    was one. rayspeed reports no checkpoint to Ray Train (its manifests are the one index and retention their
    owner), but jobs run by rayspeed before that did: their snapshot names folders retention has since deleted, and
    Ray Train 2.60 refuses to start a run whose snapshot names a missing checkpoint
    (CheckpointManagerInitializationError). Nothing else in the snapshot is used. The file name is Ray's
    `CHECKPOINT_MANAGER_SNAPSHOT_FILENAME` (ray.train.v2._internal.constants, 2.60.0): remove this with the last
    such job."""
    if not exp.exists(RUN_SNAPSHOT):
        return False
    exp.delete(RUN_SNAPSHOT)
    return True
