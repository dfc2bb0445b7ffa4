"""The trainer the launcher builds: no idle actors that do nothing for a rayspeed job (real Ray Train classes)."""

import os
import signal
import threading
import time

from ray.train import RunConfig, ScalingConfig

from rayspeed.compat import lean_trainer_class


def _callbacks(embedded: bool, tmp_path) -> set[str]:
    trainer = lean_trainer_class(embedded)(
        train_loop_per_worker=lambda config: None,
        scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(storage_path=str(tmp_path)),
    )
    return {type(cb).__name__ for cb in trainer._create_default_callbacks()}


def test_no_dataset_manager_and_no_pg_cleaner_on_any_cluster(tmp_path):
    shared, embedded = _callbacks(False, tmp_path), _callbacks(True, tmp_path)
    # rayspeed passes no Ray Dataset: the DatasetManager actor it would start is pure overhead.
    assert "DatasetsCallback" not in shared and "DatasetsCallback" not in embedded
    # The placement group dies with the controller that made it (next test): the cleaner's actor is overhead.
    assert "PlacementGroupCleanerCallback" not in shared | embedded
    # What training needs is kept on both.
    assert {"BackendSetupCallback", "AcceleratorSetupCallback"} <= shared & embedded


def _sleeps(config):
    import time

    time.sleep(120)


def test_a_killed_controller_s_placement_group_goes_when_its_driver_exits(ray_head, tmp_path):
    """Why the cleaner is not needed on a shared cluster either. A placement group Ray Train's controller made
    outlives the controller while the driver lives (measured here), but the launcher's fit() fails when the
    controller dies and the driver exits: Ray then removes the ended job's placement groups (not detached)."""
    import ray
    from ray.util.state import list_actors

    ray.init(address=ray_head.address, logging_level="WARNING", log_to_driver=False)
    trainer = lean_trainer_class(False)(
        train_loop_per_worker=_sleeps, scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(name="pg-fate", storage_path=str(tmp_path)))
    failed: list = []
    fit = threading.Thread(target=lambda: failed.append(_fit_error(trainer)), daemon=True)
    fit.start()
    try:
        deadline = time.time() + 120
        while not _reserved() and time.time() < deadline:
            time.sleep(0.5)
        pgs = _reserved()
        assert pgs, "the worker group's placement group was never created"
        job = ray.get_runtime_context().get_job_id()
        alive = list_actors(address=ray_head.address,
                            filters=[("class_name", "=", "TrainController"), ("state", "=", "ALIVE")])
        controller = [a for a in alive if a.job_id == job]
        assert len(controller) == 1
        os.kill(controller[0].pid, signal.SIGKILL)  # ungraceful: no teardown of its own runs
        fit.join(60)
        assert failed and failed[0] is not None, "the driver did not see its run fail"
    finally:
        ray.shutdown()  # the launcher's process exits
    ray.init(address=ray_head.address, logging_level="WARNING", log_to_driver=False)
    try:
        deadline = time.time() + 60
        while set(pgs) & set(_reserved()) and time.time() < deadline:
            time.sleep(0.5)
        assert not set(pgs) & set(_reserved()), "the ended job's placement group is still reserved"
    finally:
        ray.shutdown()


def _reserved() -> list[str]:
    import ray

    return [i for i, pg in ray.util.placement_group_table().items() if pg["state"] == "CREATED"]


def _fit_error(trainer):
    try:
        trainer.fit()
    except Exception as e:
        return e
    return None


def test_a_worker_imports_deepspeed_without_mlflow_and_rank_0_can_still_load_it():
    """The worker's DeepSpeed import leaves mlflow out (rayspeed.compat.import_deepspeed_without_mlflow); a fresh
    interpreter, as a Ray worker process is."""
    import json
    import subprocess
    import sys

    code = ("import json, sys; from rayspeed import compat; ds = compat.import_deepspeed_without_mlflow(); "
            "before = 'mlflow' in sys.modules; from deepspeed.autotuning import autotuner; "
            "from mlflow.tracking import MlflowClient; "
            "print(json.dumps([before, autotuner.has_mlflow, MlflowClient.__name__]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == [False, False, "MlflowClient"]


def test_the_controller_runs_without_torch_and_a_fixed_group_without_the_autoscaling_coordinator(ray_head, tmp_path):
    """What Ray Train's controller process is handed imports no torch (rayspeed.compat.ray_backend: 1.2 s of CPU at
    every start), a fixed-size job sends no autoscaling-coordinator request (its actor is a process of its own), and
    the workers still get their process group from it, as TorchConfig made it."""
    import ray
    from ray.util.state import list_actors

    from rayspeed.compat.ray_backend import ProcessGroupConfig

    def _group_of(config):  # defined here: pickled by value (the workers cannot import this test module)
        import time

        import torch.distributed as dist

        time.sleep(config["hold_s"])  # the test looks at the controller's process meanwhile
        return [dist.get_world_size(), dist.get_backend(), dist.get_rank()]

    ray.init(address=ray_head.address, logging_level="WARNING", log_to_driver=False)
    trainer = lean_trainer_class(False)(
        train_loop_per_worker=_group_of, train_loop_config={"hold_s": 8.0},
        scaling_config=ScalingConfig(num_workers=2), torch_config=ProcessGroupConfig(backend="gloo", timeout_s=60),
        run_config=RunConfig(name="lean-controller", storage_path=str(tmp_path)))
    returned: list = []
    fit = threading.Thread(target=lambda: returned.append(trainer.fit().return_value), daemon=True)
    fit.start()
    try:
        job = ray.get_runtime_context().get_job_id()
        deadline, mine = time.time() + 120, []
        while time.time() < deadline:
            mine = [a for a in list_actors(address=ray_head.address, filters=[("state", "=", "ALIVE")])
                    if a.job_id == job]
            if sum(a.class_name == "RayTrainWorker" for a in mine) == 2:
                break
            time.sleep(0.5)
        names = sorted(a.class_name for a in mine)
        assert names.count("RayTrainWorker") == 2, names
        assert "_AutoscalingCoordinatorActor" not in names, names
        controller = [a for a in mine if a.class_name == "TrainController"]
        with open(f"/proc/{controller[0].pid}/maps") as f:
            libraries = f.read()
        assert "libtorch" not in libraries, "the controller process loaded torch"
        fit.join(120)
        assert returned == [[2, "gloo", 0]]
    finally:
        ray.shutdown()


def test_an_engine_build_no_longer_sets_up_torch_compile_for_deepspeed_s_muon():
    """DeepSpeed imports its Muon module at every ZeRO engine build, and that import set up torch.compile for three
    kernels (torch._inductor and ~1400 modules; 1.4-1.8 s of CPU per rank). With
    rayspeed.compat.muon_compiled_on_first_use the kernels are compiled on their first call instead (measured by
    hand: the first call compiles, in 17.7 s on the 2-core VM, and returns what the eager kernel returns within
    bf16). Fresh interpreters, as Ray's worker processes are."""
    import json
    import subprocess
    import sys

    def imported(patched: bool) -> list:
        code = ("import json, sys; from rayspeed import compat; compat.import_deepspeed_without_mlflow(); "
                + ("compat.muon_compiled_on_first_use(); " if patched else "")
                + "import deepspeed.runtime.zero.muon.original_muon as m; "
                "print(json.dumps(['torch._inductor' in sys.modules, "
                "getattr(m.muon_update, '__wrapped__', None) is not None]))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    assert imported(False) == [True, True]  # torch.compile's own wrapper: inductor set up at import
    assert imported(True) == [False, True]  # rayspeed's: nothing set up until the first call
