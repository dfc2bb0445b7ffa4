"""What the model's features and the job's evaluation add to a run, each a function of the trainer and the tracker
returning its Listeners (empty where it does not apply): the trainer composes them and does not ask which.

    FEATURES = (expert_load, harness, out_of_memory, router_bias)
"""

from __future__ import annotations

from typing import Any

from rayspeed.train.objective import Listeners


def expert_load(trainer: Any, tracker: Any) -> Listeners:
    """A mixture of experts' moe/* metrics and expert-load artifacts (the model's routing record)."""
    routing = trainer.engine.module.routing
    if routing is None:
        return Listeners()
    from rayspeed.train.moe_callback import ExpertLoad

    load = ExpertLoad(routing.stats, routing.moe_layers, trainer.groups, trainer.device, tracker,
                      every=trainer.cfg.tracking.charts_every_checkpoints, rows=routing.rows, pooled=routing.pooled)
    return Listeners([load], [load.metrics])


def harness(trainer: Any, tracker: Any) -> Listeners:
    """lm-eval tasks at the job's cadence (eval.harness.tasks)."""
    if not trainer.cfg.eval.harness.tasks:
        return Listeners()
    from rayspeed.train.harness_callback import HarnessCallback

    return Listeners([HarnessCallback(trainer.cfg, trainer.ctx, tracker)])


def out_of_memory(trainer: Any, tracker: Any) -> Listeners:
    """Every job: a step that runs out of device memory is recorded for the next attempt's plan."""
    from rayspeed.train.oom import OomRecorder

    return Listeners([OomRecorder(trainer, tracker)])


def router_bias(trainer: Any, tracker: Any) -> Listeners:
    """model.router_bias_update: the score corrections move toward an even load after every step."""
    speed = trainer.cfg.model.router_bias_update
    if not speed:
        return Listeners()
    from rayspeed.train.router_bias import RouterBiasUpdate

    return Listeners([RouterBiasUpdate(trainer.engine.module, speed, getattr(trainer.groups, "dpcp_group", None))])


FEATURES = (expert_load, harness, out_of_memory, router_bias)
