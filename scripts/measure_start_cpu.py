"""CPU seconds each process of the machine spends while one command runs, grouped by what it is (the driver, Ray
Train's controller and workers, Ray's own helper actors and daemons): where a start's CPU goes on a machine whose
cores are all busy during it (docs/BENCHMARKS.md "What a start costs").

    RAY_ADDRESS=... python scripts/measure_start_cpu.py python jobs/train.py --config configs/tiny-cpu.yaml \\
        --set train.max_steps=2

Every process is sampled every 0.1 s (psutil): a process that lives less than that is missed, and its last 0.1 s
too. The command's own output goes to measure_start_cpu.log in the working directory.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import time

import psutil

GROUPS = ("TrainController", "RayTrainWorker", "PlacementGroupCleaner", "PreemptionWatcher", "SynchronizationActor",
          "jobs/train.py", "raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env", "ray::IDLE")


def _name(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:150]
    except (psutil.Error, OSError):
        return ""


def main(cmd: list[str]) -> None:
    before = {}
    for p in psutil.process_iter():
        try:
            before[p.pid] = sum(p.cpu_times()[:4])
        except psutil.Error:
            pass
    seen: dict[int, list] = {}
    with open("measure_start_cpu.log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        t0 = time.time()
        while proc.poll() is None:
            for p in psutil.process_iter():
                try:
                    cpu = sum(p.cpu_times()[:4])
                except psutil.Error:
                    continue
                name = _name(p)  # a Ray worker execs into its role: the newest name is the right one
                entry = seen.setdefault(p.pid, ["", 0.0])
                entry[0], entry[1] = name or entry[0], cpu
            time.sleep(0.1)
    wall = time.time() - t0
    by: collections.Counter = collections.Counter()
    for pid, (name, cpu) in seen.items():
        spent = cpu - before.get(pid, 0.0)
        if spent >= 0.05:
            by[next((g for g in GROUPS if g in name), name[:80] or "?")] += spent
    print(f"wall {wall:.1f} s, CPU {sum(by.values()):.1f} s (exit {proc.returncode})")
    for name, spent in by.most_common(20):
        print(f"{spent:7.2f}  {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
