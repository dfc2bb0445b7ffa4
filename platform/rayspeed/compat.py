"""The one home for patches of Ray and DeepSpeed internals.

Every patch is a self-contained function whose docstring names the library version it was written for and
what breaks if that internal changes; callers fall back to the library's own behaviour where they can.
"""

from __future__ import annotations

from typing import Any

PARTS_PREFIX = "parts:"


def pipeline_explicit_parts(module: Any, method: str) -> bool:
    """DeepSpeed 0.19.8 `PipelineModule._partition_layers(method)`: an explicit stage split.

    DeepSpeed partitions its flat list of layer specs only by 'uniform', 'parameters' or 'type:<regex>', none
    of which places a chosen number of blocks on each stage. Called from a PipelineModule subclass's
    `_partition_layers` override, this accepts method = 'parts:0,b1,...,bN' (N = num_stages; stage i owns specs
    b_i:b_{i+1}, b_0 = 0, b_N = the number of specs) and sets what DeepSpeed's own partitioner sets in 0.19.8:
    `self.parts` (read by `stage_owner`, the tied-module index and `partitions()`) and the local bounds
    (`_set_bounds`, read by `_build` and the checkpoint layer paths, which stay numbered by global layer index,
    so checkpoints and `ds_to_universal` do not depend on the split). Returns False for any other method, so
    the caller runs DeepSpeed's partitioner. Raises ValueError for a split that does not cover the specs.
    """
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


def deepspeed_skip_shm_comm_op() -> None:
    """DeepSpeed 0.19.8 on the CPU accelerator: `deepspeed.init_distributed` JIT-compiles a shared-memory
    all-reduce op (ShareMemCommBuilder, used only by its inference all-reduce, never by training's gloo
    collectives): a C++ build on every fresh machine (~60 s measured) and a lock every process waits on.
    Marking the op incompatible in `deepspeed.ops.__compatible_ops__` skips the build; a DeepSpeed without the
    builder or the table is left alone."""
    try:
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is not None:
            deepspeed.ops.__compatible_ops__[builder.NAME] = False
    except Exception:  # an older/newer DeepSpeed without it: nothing to skip
        pass
