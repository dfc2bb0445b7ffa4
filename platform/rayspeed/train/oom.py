"""A step that ran out of device memory: recorded (the layout, the step, what it needed) in the experiment folder,
and planned around by the next attempt (rayspeed.planner.oom_feedback: that layout refused, the memory model
corrected by what was measured). At most resilience.oom_replans re-plans per submission; the attempt after the last
one ends the job (exit 1) with the layouts tried.

    OomRecorder(trainer, tracker)            # a feature (rayspeed.train.features.out_of_memory)
    records = submission_records(experiment_dir, launched_at)
    give_up_reason(records, allowed)         # None while another re-plan is allowed
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any, Optional

from rayspeed import paths, storage
from rayspeed.planner.hardware import GIB
from rayspeed.train.events import Callback, TrainState

log = logging.getLogger("rayspeed")

OOM_LOG = f"{paths.RESILIENCE_DIR}/oom.jsonl"
_TRIED = re.compile(r"Tried to allocate ([\d.]+) ?(B|KiB|MiB|GiB|TiB)", re.IGNORECASE)
_UNIT = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def is_out_of_memory(error: BaseException) -> bool:
    """torch.OutOfMemoryError, or an error whose message is a device allocation failure (the doctor's cuda_oom
    signatures: CUDA, cuBLAS, NCCL's CUDA calls)."""
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    from rayspeed.health.knowledge import load

    text = str(error)
    return any(r.search(text) for r in load().entry("cuda_oom").signature)


def tried_bytes(message: str) -> int:
    """The allocation that failed, from CUDA's "Tried to allocate 2.00 GiB" (0 when the message has none)."""
    m = _TRIED.search(message)
    return int(float(m.group(1)) * _UNIT[m.group(2).lower()]) if m else 0


def need_bytes(error: BaseException, device: Any) -> int:
    """A lower bound of what the step needed: the allocator's peak reserved bytes plus the failed allocation.
    0 where no device allocator counts (CPU workers: the drill), which the line says as "not measured"."""
    import torch

    if getattr(device, "type", "cpu") != "cuda":
        return 0
    return int(torch.cuda.max_memory_reserved(device)) + tried_bytes(str(error))


def submission_records(experiment_dir: str, launched_at: float) -> list[dict[str, Any]]:
    """This submission's records, one per layout (several ranks of one attempt may each record theirs)."""
    seen: dict[str, dict[str, Any]] = {}
    for r in storage.locate(experiment_dir).read_jsonl(OOM_LOG):
        if abs(float(r.get("launched_at", 0)) - launched_at) < 1e-3:
            seen.setdefault(json.dumps(r["layout"], sort_keys=True), r)
    return list(seen.values())


def describe(record: dict[str, Any]) -> str:
    lay = record["layout"]
    need = int(record.get("need_bytes") or 0)
    needed = f"needed at least {need / GIB:.2f} GiB" if need else "need not measured: no device allocator"
    return (f"dp {lay['dp']} tp {lay['tp']} pp {lay['pp']} ZeRO-{lay['zero_stage']} micro-batch "
            f"{lay['micro_batch_size']} x {lay['grad_accum']} (out of memory at step {record['step']} on rank "
            f"{record['rank']}; {needed}, predicted {int(record.get('predicted_bytes') or 0) / GIB:.2f} GiB)")


def give_up_reason(records: list[dict[str, Any]], allowed: int) -> Optional[str]:
    if len(records) <= allowed:
        return None
    tried = "; ".join(describe(r) for r in records)
    return (f"out of memory on every layout tried, {len(records)} layouts after {allowed} re-plans "
            f"(resilience.oom_replans): {tried}. Raise resilience.oom_replans, add workers, or make the job "
            "smaller (model.adapter lora, a shorter model.seq_len)")


class OomRecorder(Callback):
    def __init__(self, trainer: Any, tracker: Any):
        self.trainer, self.tracker = trainer, tracker

    def on_start(self, state: TrainState) -> None:
        records = self._tag()
        if records:
            self.tracker.log_metrics({"plan/oom_replans": float(len(records))}, step=state.step)

    def _tag(self) -> list[dict[str, Any]]:
        """Rank 0: the layouts that ran out of memory so far in this submission, as the run's tag."""
        t = self.trainer
        if not t.ctx.is_rank0:
            return []
        records = submission_records(t.ctx.experiment_dir, t.payload.launched_at)
        if records:
            self.tracker.set_tags({"rayspeed.oom_layouts": " | ".join(describe(r) for r in records)})
        return records

    def on_failure(self, state: TrainState, error: BaseException) -> None:
        if not is_out_of_memory(error):
            return
        t = self.trainer
        best = t.plan.best
        per_gib = best.get("memory_breakdown_gib") or {}
        from rayspeed.config.layout import Layout
        from rayspeed.redact import redact_text

        lay = Layout.from_parallel(t.cfg.parallel)
        layout = {**lay.record(), "activation_checkpointing": lay.activation_checkpointing,
                  "sequence_parallel": lay.sequence_parallel}
        record = {"launched_at": t.payload.launched_at, "time": time.time(), "step": state.step + 1,
                  "rank": t.ctx.rank, "layout": layout,
                  "need_bytes": need_bytes(error, t.device),
                  "predicted_bytes": int(float(best.get("memory_gib_per_gpu") or 0) * GIB),
                  "per_micro_batch_bytes": int(sum(float(per_gib.get(k, 0)) for k in ("activations", "logits_loss"))
                                               * GIB),
                  "error": redact_text(str(error).splitlines()[0] if str(error) else type(error).__name__)[:500]}
        storage.locate(t.ctx.experiment_dir).append_jsonl(OOM_LOG, record)
        log.error("out of memory: %s; the next attempt re-plans without this layout", describe(record))
        self._tag()  # before the tracker closes (it hears the failure after this callback)

