"""The end of a run, a callback: the loss landscape (a collective), the model exported (a collective) and
registered, the dashboard charts rendered from the run's history. None of it may fail the run: each part logs and
moves on.

    OutputsCallback(cfg, ctx, payload, engine, groups, device, checkpointer, landscape_batches, mlflow)
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from rayspeed import paths
from rayspeed.checkpoint import staging
from rayspeed.train.events import Callback, TrainState

log = logging.getLogger("rayspeed.worker")


class OutputsCallback(Callback):
    def __init__(self, cfg: Any, ctx: Any, payload: Any, engine: Any, groups: Any, device: Any, checkpointer: Any,
                 landscape_batches: list, mlflow: Any):
        self.cfg, self.ctx, self.payload, self.engine, self.groups = cfg, ctx, payload, engine, groups
        self.device, self.checkpointer, self.mlflow = device, checkpointer, mlflow
        self.landscape_batches = landscape_batches

    def on_end(self, state: TrainState) -> None:
        state.registered_model_version = self.finish(state.val_loss, state.last_loss)

    def finish(self, val_loss: Optional[float], last_loss: float) -> Optional[str]:
        """Landscape, export, registration and charts; returns the registered model version (rank 0) or None."""
        from rayspeed.model.export import export_model

        c, ctx, exp = self.cfg, self.ctx, self.checkpointer.exp
        landscape = self._landscape() if c.tracking.loss_landscape else None
        # The export is logged to MLflow from a local folder: on object storage it goes to node-local staging.
        out_dir: Optional[str]  # None once the export failed
        out_dir = str((exp.local if exp.is_local else self.checkpointer.stage) / paths.MODEL_DIR)
        try:
            from rayspeed.engine.build import base_state

            export_model(self.engine, c, out_dir, groups=self.groups, base=lambda: base_state(c))
        except Exception as e:
            log.warning("model export failed: %s", e)
            out_dir = None
        version = None
        try:
            version = self._register(out_dir, val_loss, last_loss, landscape)
        finally:
            if out_dir and not exp.is_local and ctx.is_rank0:
                if version is None:  # not in MLflow: keep it beside the checkpoints
                    try:
                        exp.upload_dir(out_dir, paths.MODEL_DIR)
                    except Exception as e:
                        log.warning("model export not uploaded to %s: %s", exp, e)
                staging.clean(Path(out_dir))  # staging is for transfers only
        return version

    def _landscape(self) -> Optional[dict[str, Any]]:
        c = self.cfg
        if not self.landscape_batches:  # a DPO job: the next-token loss surface is not what it trains
            return None
        try:
            from rayspeed.monitoring.landscape import loss_landscape

            mb, dev = c.parallel.micro_batch_size, self.device
            batches = [(x[:mb].to(dev), y[:mb].to(dev)) for x, y, *_ in self.landscape_batches[:2]]
            return loss_landscape(self.engine, batches, None, seed=c.train.seed, steps=11,
                                  group=self.groups.dp_group if self.groups.dp > 1 else None)
        except Exception as e:
            log.warning("loss landscape failed: %s", e)
            return None

    def _register(self, out_dir: Optional[str], val_loss: Optional[float], last_loss: float,
                  landscape: Any) -> Optional[str]:
        return register_outputs(self.cfg, self.ctx, self.payload, self.mlflow, out_dir, val_loss, last_loss,
                                landscape)


def register_outputs(c: Any, ctx: Any, payload: Any, mlflow: Any, out_dir: Optional[str], val_loss: Optional[float],
                     last_loss: float, landscape: Any) -> Optional[str]:
    """The exported model logged and registered in the job's run, and the final charts (rank 0)."""
    from rayspeed.tracking.logger import LATE_SERVER_S
    from rayspeed.tracking.runs import registered_model_name

    if ctx.is_rank0 and payload.tracking_deferred and not payload.mlflow_run_id:
        # The server never answered: a late one still gets the run and every record, if it comes up by then.
        mlflow.tracker.flush(LATE_SERVER_S)
    if not ctx.is_rank0 or not payload.mlflow_run_id:
        return None
    version = None
    if out_dir:
        from rayspeed.tracking.hf_model import job_tokenizer, log_and_register_hf

        mlflow.tracker.deliver(60)
        metrics = {"train/loss": last_loss}
        if val_loss is not None:
            metrics["val/loss"] = val_loss
        # Hugging Face format with its tokenizer, as the run's logged model, registered.
        version = log_and_register_hf(payload.tracking_uri, payload.mlflow_run_id, out_dir, registered_model_name(c),
                                      metrics, tokenizer=job_tokenizer(c.data.tokenizer, c.model.pretrained,
                                                                       for_serving=True))
    if mlflow.charts is not None:
        mlflow.charts.publish(landscape=landscape, wait_s=180)
    return version
