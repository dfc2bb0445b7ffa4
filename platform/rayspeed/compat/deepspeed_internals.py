"""DeepSpeed internals rayspeed uses (written for deepspeed 0.19.8); each says why and when it can go."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

log = logging.getLogger("rayspeed.compat")


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




def step_grad_norm(engine: Any) -> Any:
    """The global gradient norm DeepSpeed's ZeRO (1-3) or bf16 optimizer computed in the step under way, before it
    calls the client optimizer; None without such a wrapper (ZeRO-0 fp32). Why: it sits in the wrapper's
    `_global_grad_norm`, public (get_global_grad_norm) only after the step, and the watchdog's guard decides during
    it (0.19.8: stage_1_and_2.py, stage3.py, bf16_optimizer.py). Remove when DeepSpeed has a pre-update hook."""
    import torch

    opt = engine.optimizer
    return None if isinstance(opt, torch.optim.Optimizer) else getattr(opt, "_global_grad_norm", None)


class LossRider:
    """A step's loss carried in DeepSpeed's own data-parallel gradient all-reduce, so the watchdog's mean over the
    data-parallel group costs no synchronising collective of its own (it cost 3-4% of a tiny-cpu step on 2 cores).
    Why an internal: the engine has no public way to add a tensor to its reduction; `_get_gradients_for_reduction`
    is what its fallback reduction (ZeRO-0, fp32 or fp16) asks for the tensors it flattens, averages and copies back
    (0.19.8: runtime/engine.py, buffered_allreduce_fallback). The loss rides as [loss, 1]: whatever scaling the
    engine applies (predivide, postscale, average or sum), their ratio is the group's mean. ZeRO-1-3 and the bf16
    optimizer reduce elsewhere and never ask: `mean()` is then None and the caller reduces the loss itself."""

    def __init__(self, engine: Any):
        self.values: Any = None
        self.carried = False
        own = engine._get_gradients_for_reduction

        def with_loss() -> Any:
            non_expert, expert = own()
            if self.values is not None:
                self.carried = True
                non_expert = [*non_expert, self.values]
            return non_expert, expert

        engine._get_gradients_for_reduction = with_loss

    def load(self, loss: Any) -> None:
        """Before the boundary's backward: the loss to carry."""
        import torch

        self.values = torch.stack([loss.detach().float().reshape(()), torch.ones((), device=loss.device)])
        self.carried = False

    def mean(self) -> Any:
        """After it: the group's mean of the loss (a 0-d tensor), or None when the reduction did not carry it."""
        values, carried, self.values, self.carried = self.values, self.carried, None, False
        return values[0] / values[1] if carried else None


def loss_rider(engine: Any, members: tuple[int, ...]) -> LossRider | None:
    """A LossRider when the engine's gradient reduction runs over a group of one of these sizes (the data-parallel
    ranks, or those times the context-parallel ones, which hold the same loss), else None: a pipeline reduces per
    stage, and under expert parallelism DeepSpeed's group is the experts' (fewer ranks)."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    if getattr(engine, "pipeline_parallelism", False) or getattr(engine, "has_moe_layers", False) \
            or not hasattr(engine, "_get_gradients_for_reduction"):
        return None
    if dist.get_world_size(groups._get_sequence_data_parallel_group()) not in members:
        return None
    return LossRider(engine)


def import_deepspeed_without_mlflow() -> Any:
    """`import deepspeed`, without the mlflow import it makes (deepspeed.autotuning.autotuner's `try: import mlflow`,
    for the autotuner's own logging, which rayspeed never runs): 1.1 s of a worker's 1.3 s DeepSpeed import on the
    2-core demo (`python -X importtime`), paid by every rank although only rank 0 logs. mlflow is absent while
    DeepSpeed imports (the autotuner records has_mlflow False) and importable again after: rank 0 loads it when its
    logger starts, the other ranks never do. (A lazily loaded module does not help: torch's op registration walks
    sys.modules through `inspect.getmodule`, which loads it.)"""
    import sys

    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed

        return deepspeed
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    try:
        import deepspeed
    finally:
        if sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]
    return deepspeed


def muon_compiled_on_first_use() -> None:
    """DeepSpeed imports its Muon optimizer's module wherever it asks "is this Muon?" (the ZeRO sanity check at every
    engine build, ZeRO-1/2's gradient averaging, ZeRO-3 and bf16 set-up), and that module decorates its kernels with
    torch.compile at import: setting up inductor's config and backend, 1.4-1.8 s of CPU per rank at every start on
    the 2-core demo (py-spy on a worker; the bare DDP loop pays none of it). Imports the module once with DeepSpeed's
    `compiler.compile()` returning a decorator that calls torch.compile on the kernel's first call instead, so a job
    that never runs Muon never sets the compiler up, and one that does compiles as before (0.19.8)."""
    import functools
    import sys

    if "deepspeed.runtime.zero.muon.original_muon" in sys.modules:
        return
    from deepspeed.runtime import compiler

    eager_compile = compiler.compile

    def on_first_use() -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            compiled: list[Callable[..., Any]] = []

            @functools.wraps(fn)
            def call(*args: Any, **kwargs: Any) -> Any:
                if not compiled:
                    compiled.append(eager_compile()(fn))
                return compiled[0](*args, **kwargs)

            return call

        return decorate

    compiler.compile = on_first_use
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
        import deepspeed.runtime.zero.muon.original_muon  # noqa: F401
    finally:
        compiler.compile = eager_compile


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


def group_decays(engine: Any) -> list:
    """The weight decay of each of the engine's parameter groups (what repair_universal_optimizer_load restores)."""
    return [g.get("weight_decay") for g in engine.optimizer.param_groups]


def repair_universal_optimizer_load(engine: Any, decays: list) -> None:
    """DeepSpeed 0.19.8's ZeRO-3 universal load (`load_hp_checkpoint_state_from_checkpoint_dir_stage3`) gives every
    sub-group's optimizer state the same `step` tensor, which the fused and foreach AdamW increment in place once per
    group, so Adam's bias correction runs ahead after a resize; and it copies the first parameter group's settings into
    every group, so the norms and biases (weight decay 0) decay and LoRA+'s B matrices lose their learning-rate ratio.
    Each state gets its own step, each group the build's decay and the loaded schedule's learning rate. Harmless for
    the other stages. Goes when DeepSpeed loads each group's own state."""
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in base.state.values():
        step = state.get("step")
        if hasattr(step, "clone"):
            state["step"] = step.clone()
    groups = engine.optimizer.param_groups
    sched = getattr(engine, "lr_scheduler", None)
    lrs = sched.get_last_lr() if hasattr(sched, "get_last_lr") else None
    for i, g in enumerate(groups):
        if i < len(decays) and decays[i] is not None:
            g["weight_decay"] = decays[i]
        if lrs is not None and len(lrs) == len(groups):
            g["lr"] = lrs[i]


def cp_loss_scale(zero_stage: int, cp: int) -> float:
    """What a rank's loss is multiplied by before backward so that DeepSpeed adds up the gradients of a sequence's cp
    parts and averages over dp. ZeRO 0-2 divide their reduction over dp x cp by dp (the mpu's sequence-parallel size);
    DeepSpeed 0.19.8's ZeRO-3 reduce-scatter (`stage3.__avg_scatter_grads`, reduce_scatter: true, which rayspeed sets
    so every bucket takes it) averages over all dp x cp ranks, ignoring it: times cp puts the sum back. Checked by
    tests/parallel/test_context_parallel_engine.py; goes when ZeRO-3 honours the sequence-parallel size."""
    return float(cp) if zero_stage == 3 and cp > 1 else 1.0


def zero3_partition_over(model: Any, group: Any, ds_config: dict, mpu: Any) -> None:
    """Partition a built model's parameters for ZeRO-3 over `group` before deepspeed.initialize. DeepSpeed 0.19.8
    partitions a model not built under zero.Init over the mpu's data-parallel group
    (`parameter_offload._convert_to_zero_parameters`), not its sequence-data-parallel one: under cp the cp ranks
    would keep whole copies and never reduce their gradients. Parameters already partitioned are left as they are."""
    import deepspeed

    deepspeed.zero.Init(module=model, data_parallel_group=group, config_dict_or_path=ds_config, mpu=mpu)


def counted_once_in_norm(params: Any) -> None:
    """Leave these parameters out of DeepSpeed's gradient norm on this rank. DeepSpeed 0.19.8 counts a weight marked
    tensor-parallel on every rank of its model-parallel group and skips one marked `ds_pipe_replicated` (its flag
    for the copies of a weight tied across pipeline stages): under ep x tp a tp shard of a weight every ep rank holds
    alike (attention, embeddings) is such a copy on every ep rank but the first. ZeRO 1-2 and the bf16 optimizer read
    the flag, ZeRO-3 does not (config/moe_keys.py refuses ZeRO-3 with ep x tp). Goes when DeepSpeed's norm takes
    a per-parameter replica group."""
    for p in params:
        p.ds_pipe_replicated = True
