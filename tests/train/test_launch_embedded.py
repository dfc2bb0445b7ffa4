"""The trainer the launcher builds: no idle actors that do nothing for a rayspeed job (real Ray Train classes)."""

from ray.train import RunConfig, ScalingConfig

from rayspeed.compat import lean_trainer_class


def _callbacks(embedded: bool, tmp_path) -> set[str]:
    trainer = lean_trainer_class(embedded)(
        train_loop_per_worker=lambda config: None,
        scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(storage_path=str(tmp_path)),
    )
    return {type(cb).__name__ for cb in trainer._create_default_callbacks()}


def test_no_dataset_manager_anywhere_and_no_pg_cleaner_on_the_embedded_cluster(tmp_path):
    shared, embedded = _callbacks(False, tmp_path), _callbacks(True, tmp_path)
    # rayspeed passes no Ray Dataset: the DatasetManager actor it would start is pure overhead.
    assert "DatasetsCallback" not in shared and "DatasetsCallback" not in embedded
    # A shared cluster outlives the job: its placement groups need the cleaner. The embedded one does not.
    assert "PlacementGroupCleanerCallback" in shared
    assert "PlacementGroupCleanerCallback" not in embedded
    # What training needs is kept on both.
    assert {"BackendSetupCallback", "AcceleratorSetupCallback"} <= shared & embedded

