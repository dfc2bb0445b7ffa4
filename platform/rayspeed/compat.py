"""Every use of a Ray, DeepSpeed, MLflow or torch internal, in one place, each written for the pinned versions below.

A new Ray or DeepSpeed release may move any of these. `check()` (run by tests/test_compat.py) verifies that the
installed versions are the ones written for and that every internal still exists, and says which to revisit.
Nothing here is imported by the planner: Ray and DeepSpeed are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

log = logging.getLogger("rayspeed.compat")

RAY_VERSION = "2.60.0"
DEEPSPEED_VERSION = "0.19.8"


# ---------------------------------------------------------------- Ray Train v2 (written for ray 2.60.0)


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


def lean_trainer_class(embedded: bool) -> Any:
    """TorchTrainer without DatasetsCallback (no Ray Dataset: a DatasetManager actor per attempt) and, on the
    cluster the launcher starts for itself, PlacementGroupCleanerCallback. Why: that cleaner's actor finds any other
    Ray instance on the machine, dies, and the controller waits ~20 s for it at every attempt (docs/BENCHMARKS.md;
    the seeded kill drill of make test-slow: 191 s with this class, 272 s without). Built in
    `TorchTrainer._create_default_callbacks` (2.60.0; gone: the plain trainer). Remove when Ray Train skips both."""
    from ray.train.torch import TorchTrainer

    if not hasattr(TorchTrainer, "_create_default_callbacks"):
        return TorchTrainer
    skip = {"DatasetsCallback", *(("PlacementGroupCleanerCallback",) if embedded else ())}

    class RayspeedTrainer(TorchTrainer):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            return callbacks if self.datasets else [cb for cb in callbacks if type(cb).__name__ not in skip]

    return RayspeedTrainer


def set_worker_group_start_timeout(seconds: float) -> None:
    """How long Ray Train's controller waits for a worker group to start before calling the attempt failed.

    Why: after a node loss it first retries the old size, so its default 60 s is pure recovery delay; Ray Train
    v2 reads it only from the environment variable RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (ray 2.60.0, no
    ScalingConfig/RunConfig field). Remove when Ray Train takes it as a config field. An operator's own setting
    wins."""
    import os

    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", str(seconds))


# ---------------------------------------------------------------- DeepSpeed (written for deepspeed 0.19.8)


PARTS_PREFIX = "parts:"


def pipeline_explicit_parts(module: Any, method: str) -> bool:
    """DeepSpeed 0.19.8 `PipelineModule._partition_layers(method)` for an explicit stage split, which its 'uniform',
    'parameters' and 'type:<regex>' cannot express: method = 'parts:0,b1,...,bN' (stage i owns specs b_i:b_{i+1})
    sets what DeepSpeed's partitioner sets: `self.parts` (stage_owner, tied modules, partitions()) and the local
    bounds (`_set_bounds`: _build and the checkpoint layer paths, numbered by global layer index, so checkpoints and
    ds_to_universal do not depend on the split). False for any other method (DeepSpeed's partitioner runs);
    ValueError for a split that does not cover the specs."""
    if not isinstance(method, str) or not method.lower().startswith(PARTS_PREFIX):
        return False
    try:
        parts = [int(x) for x in method[len(PARTS_PREFIX):].split(",")]
    except ValueError:
        raise ValueError(f"partition_method {method!r}: expected 'parts:' and comma-separated integers") from None
    stages = int(module.num_stages)
    num_specs = len(module._layer_specs)
    if (len(parts) != stages + 1 or parts[0] != 0 or parts[-1] != num_specs
            or any(b <= a for a, b in zip(parts, parts[1:]))):
        raise ValueError(f"partition_method {method!r}: need {stages + 1} strictly increasing boundaries from 0 to "
                         f"{num_specs} (one or more layer specs per stage)")
    module.parts = parts
    stage_id = module._topo.get_coord(module.global_rank).pipe
    module._set_bounds(start=parts[stage_id], stop=parts[stage_id + 1])
    return True


class ExplicitPipelineParts:
    """Mixed in before DeepSpeed's PipelineModule: a `parts:` partition method places the job's own per-stage
    split (parallel.stage_layers). Why: PipelineModule's partition methods are uniform/parameters/type:regex
    (deepspeed 0.19.8), and `_partition_layers` is where one is chosen. Remove when PipelineModule accepts
    explicit stage boundaries."""

    def _partition_layers(self, method: str = "uniform") -> None:
        if not pipeline_explicit_parts(self, method):
            super()._partition_layers(method)  # type: ignore[misc]


def deepspeed_comm_backend() -> Any:
    """DeepSpeed's communication backend object (`deepspeed.comm.comm.cdb`: every ZeRO, engine and pipeline
    collective goes through it), or None when deepspeed.comm is not initialised. Why: the gradient-sync timer
    (rayspeed.monitoring.comm_timer) wraps its methods; deepspeed.comm has no public hook (0.19.8). Remove when
    it offers one (its comms logger records sizes, not the time a step spends)."""
    import sys

    if "deepspeed" not in sys.modules:  # no engine without it: nothing to time, and no import to pay
        return None
    try:
        import importlib

        cdb = getattr(importlib.import_module("deepspeed.comm.comm"), "cdb", None)
        if cdb is not None and cdb.is_initialized():
            return cdb
    except Exception:
        pass
    return None


@contextlib.contextmanager
def methods_replaced(obj: Any, replacements: dict[str, Any]) -> Iterator[None]:
    """Replace methods of a library object for the duration of the block, and put back exactly what was there
    (the instance's own attribute, or none, so the class's method shows through again)."""
    saved: list[tuple[str, bool, Any]] = []
    try:
        for name, fn in replacements.items():
            saved.append((name, name in vars(obj), vars(obj).get(name)))
            setattr(obj, name, fn)
        yield
    finally:
        for name, had_own, own in reversed(saved):
            try:
                if had_own:
                    setattr(obj, name, own)
                else:
                    delattr(obj, name)
            except Exception:
                pass


def fused_optimizer_devices() -> tuple[str, ...]:
    """The device types torch's fused AdamW runs on. Why: torch has no public query (2.13); the fused CPU kernel
    saves ~6% of a CPU step (engine/optim.py). Remove when torch exposes one. If the helper moves: () (torch's
    default implementation is used)."""
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        return tuple(_get_fused_kernels_supported_devices())
    except Exception:
        return ()


def compile_errors_fall_back_to_eager() -> None:
    """A torch.compile failure runs that frame eagerly, with a warning, instead of failing the job
    (train.compile: auto). Why: `torch._dynamo.config.suppress_errors` is the only switch (torch 2.13). Remove
    when torch.compile takes a per-call fallback option."""
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True


def skip_deepspeed_shm_comm_op() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op (used by its inference all-reduce, not
    by training's gloo collectives) at init_distributed: a C++ build on every fresh machine (measured ~60 s) and
    a lock every worker waits on. Marking the op incompatible in `deepspeed.ops.__compatible_ops__` skips it."""
    try:
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is not None:
            deepspeed.ops.__compatible_ops__[builder.NAME] = False
    except Exception as e:  # an older/newer DeepSpeed without it: nothing to skip
        log.debug("shm comm op not skipped: %s", e)


def async_checkpoint_problem(engine: Any) -> str | None:
    """Why `capture_checkpoint_writes` cannot make this engine's save asynchronous (None: it can). Every file of
    DeepSpeed 0.19.8's `save_checkpoint` goes through `engine.checkpoint_engine.save(state_dict, path)` when that is
    the plain TorchCheckpointEngine, except the NVMe-offload copy, which copies swap files directly."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    ce = getattr(engine, "checkpoint_engine", None)
    if type(ce) is not TorchCheckpointEngine:
        return f"DeepSpeed's checkpoint engine is {type(ce).__name__}, not TorchCheckpointEngine"
    offload = getattr(engine, "zero_nvme_offload_optimizer", None)
    if callable(offload) and offload():
        return "ZeRO NVMe offload copies its swap files during the save"
    return None


def capture_checkpoint_writes(engine: Any, copy: Any) -> Any:
    """A context manager around `engine.save_checkpoint`: every state dict DeepSpeed would write is handed to
    `copy` (a host snapshot) instead of torch.save, and yields the list of (path, snapshot) it recorded; directories
    and the files DeepSpeed copies directly (zero_to_fp32.py) are still made. The snapshots are written later with
    `writer(state, path)` (the engine's own TorchCheckpointEngine.save: the same bytes as a synchronous save).

    DeepSpeed 0.19.8: `DeepSpeedEngine.save_checkpoint` (engine.py) calls `self.checkpoint_engine.create`, `.save`
    for the model, ZeRO and pipeline-layer files, `.makedirs`, then `.commit` (not decoupled); the engine is
    swapped for the length of the call (option (b) of the checkpoint-engine abstraction: a capturing engine whose
    commit is deferred to rayspeed's background writer)."""
    import contextlib

    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    original = engine.checkpoint_engine

    class CapturingCheckpointEngine(CheckpointEngine):
        def __init__(self) -> None:
            super().__init__(None)
            self.name = "RayspeedCapturingCheckpointEngine"
            self.captured: list[tuple[str, Any]] = []

        def create(self, info: Any) -> None:
            pass

        def save(self, state_dict: Any, path: str) -> None:
            self.captured.append((str(path), copy(state_dict)))

        def makedirs(self, path: str, exist_ok: bool = False) -> None:
            original.makedirs(path, exist_ok=exist_ok)

        def load(self, path: str, map_location: Any = None) -> Any:
            return original.load(path, map_location=map_location)

        def commit(self, info: Any) -> bool:
            return True  # rayspeed commits: the manifest, once every rank's files are durable

        def is_data_parallel_writer(self, dp_rank: int) -> bool:
            return original.is_data_parallel_writer(dp_rank)

        def preserves_storage_sharing(self) -> bool:
            return original.preserves_storage_sharing()

    @contextlib.contextmanager
    def swapped() -> Any:
        capture = CapturingCheckpointEngine()
        engine.checkpoint_engine = capture
        try:
            yield capture.captured
        finally:
            engine.checkpoint_engine = original

    return swapped()


def checkpoint_writer(engine: Any) -> Any:
    """(state, path) -> None: how this engine's TorchCheckpointEngine writes one file (torch.save with its
    serialization setting); safe to call from a background thread (no collectives)."""
    ce = engine.checkpoint_engine
    return lambda state, path: ce.save(state, path)


# ---------------------------------------------------------------- MLflow (written for mlflow 3.17)


MLFLOW_PROCESS_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_ID")


@contextlib.contextmanager
def mlflow_process_state() -> Iterator[None]:
    """Put back, after the block, MLflow's process-wide store settings exactly as they were: the tracking and
    registry URI globals, the active experiment, and the MLFLOW_* variables the setters export for subprocesses."""
    import os

    from mlflow.tracking import fluent
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    saved = (tracking_utils._tracking_uri, registry_utils._registry_uri, fluent._active_experiment_id)
    env = {k: os.environ.get(k) for k in MLFLOW_PROCESS_ENV}
    try:
        yield
    finally:
        tracking_utils._tracking_uri, registry_utils._registry_uri, fluent._active_experiment_id = saved
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def mlflow_process_store(uri: str) -> Iterator[None]:
    """MLflow's process-wide tracking and registry URIs at `uri` for the block, then as they were.
    `mlflow.<flavor>.log_model`, `register_model` and `models:/` URIs only resolve against the process-wide store;
    left set, they would send every later MlflowClient without an explicit registry URI (and every later job in a
    long-lived driver) to this job's store."""
    import mlflow

    with mlflow_process_state():
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        yield


# ---------------------------------------------------------------- the check


def check() -> list[str]:
    """Problems with the installed Ray/DeepSpeed for the internals above (empty when all is as written for)."""
    problems = []
    import deepspeed
    import ray

    if ray.__version__ != RAY_VERSION:
        problems.append(f"ray {ray.__version__} is installed, rayspeed.compat was written for {RAY_VERSION}: "
                        "re-check every Ray internal in rayspeed/compat.py")
    if deepspeed.__version__ != DEEPSPEED_VERSION:
        problems.append(f"deepspeed {deepspeed.__version__} is installed, rayspeed.compat was written for "
                        f"{DEEPSPEED_VERSION}: re-check every DeepSpeed internal in rayspeed/compat.py")
    try:
        controller_callback_bases()
    except ImportError as e:
        problems.append(f"ray.train.v2._internal.execution.callback moved ({e})")
    try:
        from ray.train.v2._internal.execution.scaling_policy import elastic

        if not hasattr(elastic.ElasticScalingPolicy, "_count_possible_workers"):
            problems.append("ElasticScalingPolicy._count_possible_workers is gone: count_live_workers_only is a no-op")
        if not hasattr(elastic.ElasticScalingPolicy, "make_decision_for_non_running_worker_group"):
            problems.append("ElasticScalingPolicy.make_decision_for_non_running_worker_group is gone: "
                            "fail_after_capacity_wait cannot bound the wait for workers")
    except ImportError as e:
        problems.append(f"ray.train.v2._internal.execution.scaling_policy.elastic moved ({e})")
    try:
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
        from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
        from deepspeed.runtime.engine import DeepSpeedEngine

        missing = [m for m in ("create", "save", "makedirs", "load", "commit", "is_data_parallel_writer",
                               "preserves_storage_sharing") if not hasattr(CheckpointEngine, m)]
        if missing or not issubclass(TorchCheckpointEngine, CheckpointEngine):
            problems.append(f"DeepSpeed's CheckpointEngine interface changed ({missing}): async checkpoints "
                            "(capture_checkpoint_writes) must be re-checked")
        import inspect

        src = inspect.getsource(DeepSpeedEngine.save_checkpoint)
        if "self.checkpoint_engine.commit" not in src or "self.checkpoint_engine.create" not in src:
            problems.append("DeepSpeedEngine.save_checkpoint no longer creates/commits through its checkpoint engine: "
                            "async checkpoints (capture_checkpoint_writes) must be re-checked")
    except ImportError as e:
        problems.append(f"deepspeed.runtime.checkpoint_engine moved ({e}): async checkpoints cannot capture writes")
    import deepspeed.ops
    from deepspeed.runtime.pipe.module import PipelineModule

    for attr in ("_partition_layers", "_set_bounds"):
        if not hasattr(PipelineModule, attr):
            problems.append(f"PipelineModule.{attr} is gone: pipeline_explicit_parts cannot place stage_layers")
    from ray.train.torch import TorchTrainer

    if not hasattr(TorchTrainer, "_create_default_callbacks"):
        problems.append("TorchTrainer._create_default_callbacks is gone: lean_trainer_class falls back to TorchTrainer")
    import importlib

    if not hasattr(importlib.import_module("deepspeed.comm.comm"), "cdb"):
        problems.append("deepspeed.comm.comm.cdb is gone: the gradient-sync timer measures nothing")
    if not fused_optimizer_devices():
        problems.append("torch.optim.optimizer._get_fused_kernels_supported_devices is gone: AdamW runs unfused")
    import torch._dynamo

    if not hasattr(torch._dynamo.config, "suppress_errors"):
        problems.append("torch._dynamo.config.suppress_errors is gone: a compile error fails the job")
    if not hasattr(deepspeed.ops, "__compatible_ops__"):
        problems.append("deepspeed.ops.__compatible_ops__ is gone: the CPU shm comm op is compiled again at start")
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    if not (hasattr(tracking_utils, "_tracking_uri") and hasattr(registry_utils, "_registry_uri")):
        problems.append("mlflow's _tracking_uri/_registry_uri globals moved: mlflow_process_store cannot restore "
                        "the process-wide store")
    from mlflow.tracking import fluent

    if not hasattr(fluent, "_active_experiment_id"):
        problems.append("mlflow.tracking.fluent._active_experiment_id moved: mlflow_process_store cannot restore "
                        "the active experiment")
    return problems
