"""Benchmark evaluation with lm-evaluation-harness: a committed checkpoint -> its model in Hugging Face format ->
task scores, in a process of its own (a Ray task or a background process), never in the training loop.

    harness.metrics_of(results)              # {"eval/<task>/<metric>": value} (MLflow's key rules)
    runner = runner_for(under_ray, settings)  # RayRunner | ProcessRunner
    runner.submit(step, checkpoint_dir, out_dir); runner.finished()
"""
