"""Callbacks: your code at the points of a run where something happened (`distzo.Trainer(...,
callbacks=[...])`). Every rank calls them, at the same points; use `trainer.is_main` for what only
one rank should do (writing a file, printing). A callback that raises stops the run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from .training import StepRecord, Summary, Trainer


class Callback:
    """Override the methods you need; each does nothing by default."""

    def on_train_begin(self, trainer: Trainer) -> None:
        """`fit` starts its loop (after the validation before training, when the run starts at step 0)."""

    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None:
        """A step is done and logged (`record.step` steps done)."""

    def on_evaluate(self, trainer: Trainer, split: str, result: dict[str, Any]) -> None:
        """An evaluation of `split` at `trainer.step_count` steps is done."""

    def on_snapshot(self, trainer: Trainer, step: int, path: Path | None) -> None:
        """A snapshot of the weights after `step` steps is written (its path on rank 0, None elsewhere)."""

    def on_train_end(self, trainer: Trainer, summary: Summary) -> None:
        """`fit` has finished: the final evaluations are done, the model saved, the summary written."""


class CallbackList(Callback):
    """Several callbacks called in order."""

    def __init__(self, callbacks: Sequence[Callback] = ()):
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"{cb!r} is not a distzo.Callback; subclass it and override the methods you need")

    def on_train_begin(self, trainer):
        for cb in self.callbacks:
            cb.on_train_begin(trainer)

    def on_step_end(self, trainer, record):
        for cb in self.callbacks:
            cb.on_step_end(trainer, record)

    def on_evaluate(self, trainer, split, result):
        for cb in self.callbacks:
            cb.on_evaluate(trainer, split, result)

    def on_snapshot(self, trainer, step, path):
        for cb in self.callbacks:
            cb.on_snapshot(trainer, step, path)

    def on_train_end(self, trainer, summary):
        for cb in self.callbacks:
            cb.on_train_end(trainer, summary)
