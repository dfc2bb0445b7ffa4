"""What Ray Train's controller process is handed by the launcher, without torch in it (written for ray 2.60.0).

Ray Train's controller is a new process at every job. It unpickles the trainer's backend config, and TorchConfig
lives in `ray.train.torch.config`, which imports torch at its top: 1.2-1.3 s of CPU in a process that never touches
a tensor, on the start's critical path (the workers wait for the controller; docs/BENCHMARKS.md "What a start
costs"). `ProcessGroupConfig` does what TorchConfig does for the backends rayspeed uses (gloo, nccl; `env://`) from
this module, which imports no torch: the worker-side steps are Ray's own functions, looked up on the worker.

Also here: a fixed-size job's scaling policy without Ray Train's autoscaling coordinator (a ray.data actor: a
process, its imports and a blocking request before the first worker is asked for). A fixed-size worker group waits
on a placement group, and a pending placement group is itself the demand Ray's autoscaler scales for; the
coordinator arbitrates between Ray Data and Ray Train, and rayspeed runs no Ray Data. Elastic jobs keep it: Ray
Train's elastic policy sizes the group from the coordinator's reservations.

Imported by the launcher only (it imports ray.train); remove each part when Ray Train's controller stops needing it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import ray
from ray.train.backend import Backend, BackendConfig
from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy


def _torch_config(name: str, **kwargs: Any) -> Any:
    """Run `ray.train.torch.config.<name>` on a worker (which imports torch for the job anyway)."""
    from ray.train.torch import config

    return getattr(config, name)(**kwargs)


def _address_and_port() -> tuple[str, int]:
    from ray.train._internal.utils import get_address_and_port

    return get_address_and_port()


def _set_master(addr: str, port: int) -> None:
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)


class _DeviceContext:
    """TorchConfig's train-function context: a GPU worker's current device is its own before the loop runs."""

    def __enter__(self) -> None:
        import torch

        if torch.cuda.is_available():
            from ray.train.torch import get_device

            device = get_device()
            if device.type == "cuda":
                torch.cuda.set_device(device)

    def __exit__(self, *exc: Any) -> bool:
        return False


class _ProcessGroupBackend(Backend):
    # As TorchConfig's backend: the workers of a node see all its GPUs (rayspeed picks each one's by local rank).
    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group: Any, backend_config: "ProcessGroupConfig") -> None:
        addr, port = worker_group.execute_single(0, _address_and_port)
        worker_group.execute(_set_master, addr=addr, port=port)
        worker_group.execute(_torch_config, "_set_torch_distributed_env_vars")
        ray.get([worker_group.execute_single_async(i, _torch_config, "_setup_torch_process_group",
                                                   backend=backend_config.backend, world_rank=i,
                                                   world_size=len(worker_group), init_method="env://",
                                                   timeout_s=backend_config.timeout_s)
                 for i in range(len(worker_group))])

    def on_shutdown(self, worker_group: Any, backend_config: "ProcessGroupConfig") -> None:
        from ray.exceptions import GetTimeoutError

        futures = worker_group.execute_async(_torch_config, "_shutdown_torch",
                                             destroy_process_group=len(worker_group) > 1)
        try:
            ray.get(futures, timeout=backend_config.shutdown_timeout_s)
        except GetTimeoutError:
            pass  # as Ray's own: the workers are being torn down anyway


@dataclass
class ProcessGroupConfig(BackendConfig):
    """TorchConfig(backend=..., timeout_s=...) with init_method "env", importable without torch."""

    backend: str = "gloo"
    timeout_s: int = 1800
    shutdown_timeout_s: float = 30.0

    @property
    def backend_cls(self) -> type:
        return _ProcessGroupBackend

    @property
    def train_func_context(self) -> type:
        return _DeviceContext

    @property
    def framework(self) -> Any:
        from ray.train.v2._internal.util import TrainingFramework

        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class FixedWithoutCoordinator(FixedScalingPolicy):
    """FixedScalingPolicy that sends no request to the autoscaling coordinator (the module docstring says why)."""

    def after_controller_start(self, train_run_context: Any) -> None:
        self._requester_id = f"train-{train_run_context.run_id}"

    def _maybe_send_resource_request(self) -> None:
        return None
