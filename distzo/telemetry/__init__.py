"""What a run reports: metrics lines and progress, phase timers, JSON-lines files, sinks (wandb)."""
