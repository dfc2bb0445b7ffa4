"""The end of a run: the loss landscape (a collective), the model exported (a collective) and registered, the
dashboard charts rendered from the run's history. None of it may fail the run: each part logs and moves on."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from rayspeed import paths
from rayspeed.checkpoint import staging

log = logging.getLogger("rayspeed.worker")


def finish_outputs(trainer: Any, val_loss: Optional[float], last_loss: float) -> Optional[str]:
    """Landscape, export, registration and charts; returns the registered model version (rank 0) or None."""
    from rayspeed.model.export import export_model

    c, ctx, exp = trainer.cfg, trainer.ctx, trainer.checkpointer.exp
    landscape = _landscape(trainer) if c.tracking.loss_landscape else None
    # The export is logged to MLflow from a local folder: on object storage it goes to node-local staging.
    out_dir: Optional[str] = str((exp.local if exp.is_local else trainer.checkpointer.stage) / paths.MODEL_DIR)
    try:
        export_model(trainer.engine, c, out_dir, groups=trainer.groups)
    except Exception as e:
        log.warning("model export failed: %s", e)
        out_dir = None
    version = None
    try:
        version = _register(trainer, out_dir, val_loss, last_loss, landscape)
    finally:
        if out_dir and not exp.is_local and ctx.is_rank0:
            if version is None:  # not in MLflow: keep it beside the checkpoints
                try:
                    exp.upload_dir(out_dir, paths.MODEL_DIR)
                except Exception as e:
                    log.warning("model export not uploaded to %s: %s", exp, e)
            staging.clean(Path(out_dir))  # staging is for transfers only
    return version


def _landscape(trainer: Any) -> Optional[dict[str, Any]]:
    c = trainer.cfg
    try:
        from rayspeed.monitoring.landscape import loss_landscape

        mb = c.parallel.micro_batch_size
        batches = [(x[:mb].to(trainer.device), y[:mb].to(trainer.device)) for x, y, *_ in trainer.validator.batches[:2]]
        return loss_landscape(trainer.engine, batches, None, seed=c.train.seed, steps=11,
                              group=trainer.groups.dp_group if trainer.groups.dp > 1 else None)
    except Exception as e:
        log.warning("loss landscape failed: %s", e)
        return None


def _register(trainer: Any, out_dir: Optional[str], val_loss: Optional[float], last_loss: float,
              landscape: Any) -> Optional[str]:
    from rayspeed.tracking.runs import registered_model_name

    c, ctx, payload, reporter = trainer.cfg, trainer.ctx, trainer.payload, trainer.reporter
    if ctx.is_rank0 and payload.tracking_deferred and not payload.mlflow_run_id:
        reporter.tracker.flush(60)  # a server back by now gets the run (created on the logger's thread) first
    if not ctx.is_rank0 or not payload.mlflow_run_id:
        return None
    version = None
    if out_dir:
        from rayspeed.tracking.hf_model import job_tokenizer, log_and_register_hf

        reporter.tracker.flush(60)
        metrics = {"train/loss": last_loss}
        if val_loss is not None:
            metrics["val/loss"] = val_loss
        # Hugging Face format with its tokenizer, as the run's logged model, registered.
        version = log_and_register_hf(payload.tracking_uri, payload.mlflow_run_id, out_dir, registered_model_name(c),
                                      metrics, tokenizer=job_tokenizer(c.data.tokenizer, c.model.pretrained,
                                                                       for_serving=True))
        if version:
            log.info("model registered as %s version %s", registered_model_name(c), version)
    if reporter.charts is not None:
        reporter.charts.publish(landscape=landscape, wait_s=180)
    return version
