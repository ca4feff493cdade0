"""Learning-rate schedules. MeZO trains with a constant rate; linear decay (after optional warm-up) is the
usual alternative. The rate is a pure function of the step, so resumed and replayed runs agree."""

from __future__ import annotations


def learning_rate(step: int, base: float, total_steps: int, schedule: str = "constant", warmup_steps: int = 0) -> float:
    """The rate applied by update number `step` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return base * (step + 1) / warmup_steps
    if schedule == "constant":
        return base
    if schedule == "linear":
        span = max(1, total_steps - warmup_steps)
        return base * max(0.0, (total_steps - step) / span)
    raise ValueError(f"unknown learning-rate schedule {schedule!r}")
