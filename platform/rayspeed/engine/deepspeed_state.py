"""A DeepSpeed engine's state under the checkpoint protocol (the EngineState of engine/engine_state.py), and all
that rayspeed knows of DeepSpeed's checkpoint files: the tag folders, the module-state and pipeline-layer file
names that consolidation reads, fp32 consolidation of ZeRO partitions and the universal-checkpoint converter.
Library internals (the capturing checkpoint engine) stay in rayspeed.compat."""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from rayspeed import compat
from rayspeed.config.adapter import is_adapter

TAG = "ds"
"""The folder of a checkpoint DeepSpeed saves into."""
UNIVERSAL_TAG = "ds_universal"
"""The folder the universal converter writes (loaded after a layout change)."""

LAYER_FILE = re.compile(r"layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")


def model_states_file(tp_rank: int) -> str:
    """The module states DeepSpeed writes per tensor-parallel rank (non-pipeline engines)."""
    return f"mp_rank_{tp_rank:02d}_model_states.pt"


def layer_files(folder: Path) -> list[tuple[Path, int, int]]:
    """(file, layer index, tensor-parallel rank) of every pipeline-layer module state in folder, sorted by name."""
    out = []
    for f in sorted(Path(folder).glob("layer_*-model_states.pt")):
        m = LAYER_FILE.match(f.name)
        if m:
            out.append((f, int(m.group(1)), int(m.group(2) or 0)))
    return out


def fp32_from_zero(ckpt_dir: Path) -> dict[str, Any]:
    """The fp32 master weights assembled from the ZeRO data-parallel partitions (DeepSpeed's zero_to_fp32)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):  # it prints its progress
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=TAG)


def universal_command(ckpt_dir: Path, workers: int) -> list[str]:
    """DeepSpeed's converter from the ZeRO partitions in <ckpt>/ds to a universal checkpoint in <ckpt>/ds_universal,
    with its parallel extract and merge workers."""
    return [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
            "--input_folder", str(Path(ckpt_dir) / TAG), "--output_folder", str(Path(ckpt_dir) / UNIVERSAL_TAG),
            "--inject_missing_state", "--num_extract_workers", str(workers), "--num_merge_workers", str(workers)]


def expert_universal_info(module: Any) -> dict[str, Any]:
    """What DeepSpeed's universal converter needs to know of a model whose experts are sharded over ep ranks (the
    ranks it reads as model-parallel slices): every weight but the experts is the same on each rank (taken once);
    the expert stacks, rows in rank order, are concatenated along the expert dimension (its default), so a new ep
    takes its own rows back (DeepSpeedView.get_slice_parallel_world_size). Empty without sharded experts."""
    from deepspeed.checkpoint.constants import TP_REPLICATED_PARAMETER_PATTERNS, UNIVERSAL_CHECKPOINT_INFO

    experts = [n for n, p in module.named_parameters() if getattr(p, "expert_parallel", False)]
    if not experts:
        return {}
    anything_else = "^(?!(?:" + "|".join(re.escape(n) for n in experts) + ")$)"
    return {UNIVERSAL_CHECKPOINT_INFO: {TP_REPLICATED_PARAMETER_PATTERNS: [anything_else]}}


def with_universal_load(ds_config: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config that loads a universal checkpoint (what the engine must be built with)."""
    return {**ds_config, "checkpoint": {"load_universal": True}}


class DeepSpeedState:
    def __init__(self, engine: Any):
        self.engine = engine
        # An adapter job's frozen base is not saved (the build reloads it from model.pretrained): the checkpoint
        # holds what trains, its optimizer state, schedule and RNG. A full fine-tune's frozen parameters (routers
        # kept as loaded, score corrections moved by router_bias_update) are few, and saved.
        module = getattr(engine, "module", None)
        named = list(module.named_parameters()) if module is not None else []
        self.frozen = any(not p.requires_grad for _, p in named) and any(
            p.requires_grad and is_adapter(n) for n, p in named)
        self.universal_info = expert_universal_info(module) if module is not None else {}

    def save(self, folder: Path, client_state: dict[str, Any]) -> None:
        self.engine.save_checkpoint(str(folder), tag=TAG, client_state={**client_state, **self.universal_info},
                                    save_latest=False,
                                    exclude_frozen_parameters=self.frozen)

    def load(self, folder: Path, *, universal: bool = False, module_only: bool = False) -> Optional[dict[str, Any]]:
        full = not module_only
        decay = compat.group_decays(self.engine) if universal and full else None
        _, client = self.engine.load_checkpoint(str(folder), tag=UNIVERSAL_TAG if universal else TAG,
                                                load_optimizer_states=full, load_lr_scheduler_states=full,
                                                load_module_only=module_only, load_module_strict=not self.frozen)
        if decay is not None:
            compat.repair_universal_optimizer_load(self.engine, decay)
        return client

    def capture(self, folder: Path, client_state: dict[str, Any], copy: Callable[[Any], Any]) -> list[tuple[str, Any]]:
        with compat.capture_checkpoint_writes(self.engine, copy) as captured:
            self.save(folder, client_state)
        return list(captured)

    def writer(self) -> Callable[[Any, str], None]:
        return compat.checkpoint_writer(self.engine)

    def async_problem(self) -> Optional[str]:
        return compat.async_checkpoint_problem(self.engine)

    def versions(self) -> dict[str, str]:
        import deepspeed

        return {"deepspeed": deepspeed.__version__}
