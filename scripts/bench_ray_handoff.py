"""Ray Train's own hand-off, without rayspeed's work in it: seconds from `fit()` to a train function that returns at
once, on a fresh local cluster, for Ray Train's environment switches (docs/BENCHMARKS.md "Ray Train's hand-off").

    python scripts/bench_ray_handoff.py                 # every setting, 3 fits each, one JSON line per setting
    python scripts/bench_ray_handoff.py default poll0.5

Each setting runs in its own process (Ray Train reads the variables when its controller starts), with rayspeed's
TorchTrainer (the launcher's, without the callbacks it drops) and 2 gloo workers of 1 CPU.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

PRELOAD = ["torch", "ray.train.torch", "ray.train.v2._internal.execution.controller"]
SETTINGS = {
    "default": {},
    "poll0.5": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"},
    "nowatcher": {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"},
    "nostate": {"RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0"},
    "all": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
            "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0", "RAY_USAGE_STATS_ENABLED": "0"},
    # Ray's own worker pool: processes started before they are asked for, with modules imported before work comes.
    "prestart": {"RAYSPEED_HANDOFF_SYSTEM": json.dumps({"enable_worker_prestart": True})},
    "preload": {"RAYSPEED_HANDOFF_SYSTEM": json.dumps({"preload_python_modules": PRELOAD})},
    "prestart+preload": {"RAYSPEED_HANDOFF_SYSTEM": json.dumps({"enable_worker_prestart": True,
                                                                 "preload_python_modules": PRELOAD})},
}
FITS = 3


def _entered(config):
    import time

    return time.time()


def _fits() -> None:
    import tempfile

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from rayspeed.compat import lean_trainer_class

    system = json.loads(os.environ.get("RAYSPEED_HANDOFF_SYSTEM", "{}"))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=system)
    time.sleep(float(os.environ.get("RAYSPEED_HANDOFF_IDLE_S", "5")))  # a joined cluster has been up a while
    store = tempfile.mkdtemp(prefix="rayspeed-handoff-")
    for i in range(FITS):
        t0 = time.time()
        trainer = lean_trainer_class(True)(
            _entered, scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            torch_config=TorchConfig(backend="gloo"), run_config=RunConfig(name=f"handoff{i}", storage_path=store))
        result = trainer.fit()
        t1 = time.time()
        print(json.dumps({"to_fn_s": result.return_value - t0, "after_fn_s": t1 - result.return_value}), flush=True)
    ray.shutdown()


def main(names: list[str]) -> None:
    for name in names or list(SETTINGS):
        env = dict(os.environ, **SETTINGS[name], RAYSPEED_HANDOFF_CHILD="1")
        load = round(os.getloadavg()[0], 2)  # at the start: a busy machine's figures are not a quiet one's
        out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True).stdout
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if not rows:
            print(json.dumps({"setting": name, "error": "no fit finished"}), flush=True)
            continue
        line = {"setting": name, **{k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]},
                "to_fn_each_s": [round(r["to_fn_s"], 2) for r in rows], "load_1m_at_start": load}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    if os.environ.get("RAYSPEED_HANDOFF_CHILD"):
        _fits()
    else:
        main(sys.argv[1:])
