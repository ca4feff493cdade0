"""Running: the components of a run built once, the training driver, evaluation, signals, the
benchmark, layout sweeps and replay."""
