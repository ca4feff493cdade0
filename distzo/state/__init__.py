"""A run's state on disk: snapshots and the final model folder, resuming an interrupted run."""
