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
