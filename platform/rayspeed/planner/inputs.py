"""The job as the planner sees it (Ctx): one of the two inputs of every estimate, with a candidate
rayspeed.config.layout.Layout."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from rayspeed.config.shape import ModelShape
from rayspeed.planner.hardware import Hardware


@dataclass(frozen=True)
class Ctx:
    shape: ModelShape
    hw: Hardware
    precision: Literal["fp32", "bf16", "fp16"]  # resolved
    grad_accum_dtype: str  # fp32 | bf16
    world: int
    node_size: int  # ranks per node for topology (tp never spans one)
    global_batch: int  # sequences per optimizer step
    memory_gib: float  # device (or per-worker) memory
    usable_fraction: float = 0.95  # what the driver keeps beyond the CUDA context; the model's uncertainty is margin.py
    notes: tuple = field(default_factory=tuple)  # assumptions made while building the context
    gemm_table: tuple = ()  # ((m, k, n, flop/s), ...) measured by `rayspeed calibrate` on this cluster
    efficiency: tuple = (1.0, 1.0, 1.0)  # (compute, comm, overhead) factors fitted from finished runs
    profile: str = ""  # where the hardware profile came from ("" = the built-in table)
    model_error: float = 0.0  # the time model's held-out relative error from the profile's fit (0: unknown)
    engine_by_zero: tuple = ()  # ((zero, host fwd us/block, host bwd us/block, fixed us/micro-batch, step s), ...)
    gloo_fit: tuple = ()  # ((kind, latency us, bus GB/s), ...) measured per collective on CPU workers
    # NCCL_ALGO as deployed: "" = NCCL's own choice per call; "tree" = forced (it binds all-reduces only: NCCL has
    # no tree all-gather or reduce-scatter and runs those as rings).
    nccl_algo: str = ""
    document_masking: bool = False  # data.document_masking: a [b, 1, s, s] mask per block, k/v expanded (memory.py)
    cp_scheme: str = "auto"  # parallel.cp_scheme as set (config/context_split.py resolves auto per layout)
    adapter: Any = None  # planner.adapter_terms.AdapterPlan of model.adapter (None: every parameter trains)
    dpo: Any = None  # planner.dpo_terms.DpoPlan of train.objective dpo (None: next-token loss)
    grpo: Any = None  # planner.grpo_terms.GrpoPlan of train.objective grpo: sampling between steps (ZeRO 0-2 only)
    image: Any = None  # planner.image_terms.ImagePlan of a vision-language model's image path (None: text only)
    rows_per_sample: int = 1  # sequences a sample is (2 for a DPO pair) while its layout still counts samples
    oom: Any = None  # planner.oom_feedback.OomFeedback: layouts that ran out of memory in this submission
    # Costs shared by many layouts of one search (block, head, split), keyed by what they depend on; never
    # copied by dataclasses.replace (init=False), so a changed context starts empty.
    memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def in_rows(self, lay: Any) -> tuple["Ctx", Any]:
        """(ctx, layout) costed in sequences: a DPO micro-batch of b pairs is 2b rows through the model, its global
        batch 2G (the layout keeps counting pairs; the costing sees what the GPUs run)."""
        if self.rows_per_sample == 1:
            return self, lay
        rows = self.memo.get(("rows",))
        if rows is None:
            rows = self.memo[("rows",)] = dataclasses.replace(self, rows_per_sample=1,
                                                              global_batch=self.global_batch * self.rows_per_sample)
        return rows, dataclasses.replace(lay, micro_batch_size=lay.micro_batch_size * self.rows_per_sample)

    @property
    def compute_factor(self) -> float:
        return self.efficiency[0]

    @property
    def comm_factor(self) -> float:
        return self.efficiency[1]

    @property
    def overhead_factor(self) -> float:
        return self.efficiency[2]

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
