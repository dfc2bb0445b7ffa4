"""rayspeed.monitoring: what the worker measures besides the loss.

- system.SystemSampler / system_gather.gather_system_metrics: every rank's CPU, memory and GPU numbers, to rank 0.
- comm.CommTimer: measured time in gradient collectives per step (comm/grad_sync_fraction).
- landscape.loss_landscape: loss along filter-normalised random directions (Li et al. 2018).

Each is cheap when idle, imports torch/deepspeed lazily, and never raises into the training loop.
"""

from rayspeed.monitoring.comm_timer import CommTimer
from rayspeed.monitoring.landscape import loss_landscape
from rayspeed.monitoring.system import SystemSampler, lineage_params
from rayspeed.monitoring.system_gather import gather_system_metrics

__all__ = ["CommTimer", "SystemSampler", "gather_system_metrics", "lineage_params", "loss_landscape"]
