"""The two inputs of every estimate: the job as the planner sees it (Ctx) and one candidate layout."""

from __future__ import annotations

from dataclasses import dataclass, field

from rayspeed.planner.hardware import Hardware
from rayspeed.planner.model_math import Shape

LAYOUT_KEYS = ("dp", "tp", "pp", "zero_stage", "micro_batch_size", "grad_accum", "sequence_parallel",
               "activation_checkpointing")
CHECKPOINT_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero_stage: int
    micro_batch_size: int
    grad_accum: int
    sequence_parallel: bool
    activation_checkpointing: str
    hpz: int = 1
    """ZeRO++ hierarchical partitioning (zero_hpz_partition_size): ZeRO-3 keeps a secondary copy of the weights
    partitioned over this many ranks of a node, so backward all-gathers stay on NVLink. 1 = off. Not a job key:
    the communication rule for 64+ GPUs turns it on when it fits."""

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in LAYOUT_KEYS}

    def short(self) -> str:
        sp = "+sp" if self.sequence_parallel else ""
        hpz = f" hpz{self.hpz}" if self.hpz > 1 else ""
        return (f"dp{self.dp} tp{self.tp}{sp} pp{self.pp} zero{self.zero_stage}{hpz} mb{self.micro_batch_size}"
                f" ga{self.grad_accum} ckpt={self.activation_checkpointing}")


@dataclass(frozen=True)
class Ctx:
    shape: Shape
    hw: Hardware
    precision: str  # fp32 | bf16 | fp16 (resolved)
    grad_accum_dtype: str  # fp32 | bf16
    world: int
    node_size: int  # ranks per node for topology (tp never spans one)
    global_batch: int  # sequences per optimizer step
    memory_gib: float  # device (or per-worker) memory
    usable_fraction: float = 0.95  # headroom for what the model does not see (allocator spikes, NCCL growth)
    notes: tuple = field(default_factory=tuple)  # assumptions made while building the context

    @property
    def nodes(self) -> int:
        return -(-self.world // self.node_size)

    @property
    def usable_gib(self) -> float:
        return self.memory_gib * self.usable_fraction

    @property
    def w_bytes(self) -> int:
        """Bytes of a working weight / activation element."""
        return 4 if self.precision == "fp32" else 2

    @property
    def comm_bytes(self) -> int:
        """Bytes per gradient element on the wire: the engine reduces gradients in fp32 (DeepSpeed
        communication_data_type fp32, the field guide's precision-drift remedy), whatever the precision."""
        return 4
