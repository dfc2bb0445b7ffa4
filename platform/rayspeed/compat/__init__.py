"""Every use of a Ray, DeepSpeed, MLflow or torch internal, in this package
(one module per library), each written for the pinned versions below.

A new Ray or DeepSpeed release may move any of these. `check()` (run by tests/test_codebase.py) verifies that the
installed versions are the ones written for and that every internal still exists, and says which to revisit.
Nothing here is imported by the planner: Ray and DeepSpeed are imported inside the functions.
"""

from __future__ import annotations

from rayspeed.compat.datasets_internals import dataset_fingerprint
from rayspeed.compat.deepspeed_internals import (
    PARTS_PREFIX,
    ExplicitPipelineParts,
    async_checkpoint_problem,
    capture_checkpoint_writes,
    checkpoint_writer,
    cp_loss_scale,
    deepspeed_comm_backend,
    group_decays,
    import_deepspeed_without_mlflow,
    loss_rider,
    methods_replaced,
    muon_compiled_on_first_use,
    pipeline_explicit_parts,
    repair_universal_optimizer_load,
    skip_deepspeed_shm_comm_op,
    step_grad_norm,
    zero3_partition_over,
)
from rayspeed.compat.mlflow_internals import MLFLOW_PROCESS_ENV, mlflow_process_state, mlflow_process_store
from rayspeed.compat.ray_internals import (
    controller_callback_bases,
    count_live_workers_only,
    fail_after_capacity_wait,
    forget_reported_checkpoints,
    lean_trainer_class,
    set_worker_group_start_timeout,
)
from rayspeed.compat.torch_internals import (
    compile_errors_fall_back_to_eager,
    fused_optimizer_devices,
    storage_identity,
)

RAY_VERSION = "2.60.0"
DEEPSPEED_VERSION = "0.19.8"

__all__ = ["DEEPSPEED_VERSION", "ExplicitPipelineParts", "MLFLOW_PROCESS_ENV", "PARTS_PREFIX", "RAY_VERSION",
           "async_checkpoint_problem", "capture_checkpoint_writes", "check", "checkpoint_writer",
           "compile_errors_fall_back_to_eager", "controller_callback_bases", "count_live_workers_only",
           "cp_loss_scale", "dataset_fingerprint", "deepspeed_comm_backend", "fail_after_capacity_wait",
           "forget_reported_checkpoints", "fused_optimizer_devices", "group_decays",
           "import_deepspeed_without_mlflow", "lean_trainer_class", "loss_rider", "methods_replaced",
           "mlflow_process_state",
           "mlflow_process_store", "pipeline_explicit_parts", "repair_universal_optimizer_load",
           "set_worker_group_start_timeout", "skip_deepspeed_shm_comm_op", "step_grad_norm", "storage_identity",
           "zero3_partition_over", "muon_compiled_on_first_use"]



# (module, attribute, what is lost without it): internals whose check is that they still exist.
ATTRIBUTES = [
    ("deepspeed.comm.comm", "cdb", "the gradient-sync timer measures nothing"),
    ("torch._dynamo.config", "suppress_errors", "a compile error fails the job"),
    ("deepspeed.runtime.compiler", "compile", "DeepSpeed's Muon kernels are set up for torch.compile at every "
     "engine build (muon_compiled_on_first_use)"),
    ("deepspeed.ops", "__compatible_ops__", "the CPU shm comm op is compiled again at start"),
    ("mlflow.tracking.fluent", "_active_experiment_id", "mlflow_process_store cannot restore the active experiment"),
    ("ray.train.v2.api.data_parallel_trainer", "DataParallelTrainer._initialize_and_run_controller",
     "a fixed-size job's controller asks the autoscaling coordinator again (lean_trainer_class)"),
    ("ray.train.v2._internal.execution.scaling_policy.fixed", "FixedScalingPolicy._maybe_send_resource_request",
     "FixedWithoutCoordinator no longer keeps the coordinator out (rayspeed.compat.ray_backend)"),
    *(("deepspeed.runtime.pipe.module", f"PipelineModule.{name}", "pipeline_explicit_parts cannot place stage_layers")
      for name in ("_partition_layers", "_set_bounds")),
    ("deepspeed.runtime.engine", "DeepSpeedEngine._get_gradients_for_reduction", "the watchdog's loss gets a "
     "synchronising all-reduce of its own again (loss_rider)"),
    ("deepspeed.utils.groups", "_get_sequence_data_parallel_group", "loss_rider cannot see the reduction's group"),
    ("ray.train.torch", "TorchTrainer._create_default_callbacks", "lean_trainer_class keeps Ray's callbacks"),
    ("ray.train.torch", "TorchTrainer._register_sigint_handler", "Ray Train's own Ctrl-C handling is back "
     "(rayspeed.train.interrupt never gets the controller's abort)"),
    *(("ray.train.torch.config", name, "ProcessGroupConfig cannot set the workers' process group up or down")
      for name in ("_setup_torch_process_group", "_set_torch_distributed_env_vars", "_shutdown_torch")),
]


def _has(module: str, dotted: str) -> bool:
    import importlib

    obj: object = importlib.import_module(module)
    for name in dotted.split("."):
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def check() -> list[str]:
    """Problems with the installed Ray/DeepSpeed for the internals above (empty when all is as written for)."""
    problems = []
    import deepspeed
    import ray

    if ray.__version__ != RAY_VERSION:
        problems.append(f"ray {ray.__version__} is installed, rayspeed.compat was written for {RAY_VERSION}: "
                        "re-check every Ray internal in rayspeed/compat/ray_internals.py")
    if deepspeed.__version__ != DEEPSPEED_VERSION:
        problems.append(f"deepspeed {deepspeed.__version__} is installed, rayspeed.compat was written for "
                        f"{DEEPSPEED_VERSION}: re-check every DeepSpeed internal in "
                        "rayspeed/compat/deepspeed_internals.py")
    try:
        from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME

        from rayspeed.compat.ray_internals import RUN_SNAPSHOT

        if CHECKPOINT_MANAGER_SNAPSHOT_FILENAME != RUN_SNAPSHOT:
            problems.append(f"Ray Train's run snapshot is now {CHECKPOINT_MANAGER_SNAPSHOT_FILENAME}: "
                            "forget_reported_checkpoints looks for another name")
    except ImportError as e:
        problems.append(f"ray.train.v2._internal.constants moved ({e})")
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
    for module, attr, why in ATTRIBUTES:
        if not _has(module, attr):
            problems.append(f"{module}.{attr} is gone: {why}")
    import inspect

    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    for where in (stage_1_and_2.DeepSpeedZeroOptimizer, stage3.DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer):
        if "self._global_grad_norm" not in inspect.getsource(where):
            problems.append(f"{where.__name__} keeps no _global_grad_norm: the watchdog's skip cannot see the "
                            "step's norm before the update (step_grad_norm)")
    if not fused_optimizer_devices():
        problems.append("torch.optim.optimizer._get_fused_kernels_supported_devices is gone: AdamW runs unfused")
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    if not (hasattr(tracking_utils, "_tracking_uri") and hasattr(registry_utils, "_registry_uri")):
        problems.append("mlflow's _tracking_uri/_registry_uri globals moved: mlflow_process_store cannot restore "
                        "the process-wide store")
    import torch

    if not isinstance(getattr(torch.empty(1).untyped_storage(), "_cdata", None), int):
        problems.append("torch storages have no _cdata: storage_identity (the async checkpoint's host copy) and "
                        "torch.save's storage keys must be re-checked")
    import datasets

    if dataset_fingerprint(datasets.Dataset.from_dict({"x": [1]})) is None:
        problems.append("datasets.Dataset has no _fingerprint: the data cache of an hf source no longer sees a "
                        "changed dataset (dataset_fingerprint)")
    return problems
