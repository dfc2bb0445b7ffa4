"""MLflow: one run per job, written by rank 0 through a queue that survives the server going away."""
