"""`keep_best`: the weights of a run's best validation evaluation become its result (MeZO's protocol,
transformers' `load_best_model_at_end`), not the last step's.

The candidates are the validation evaluations of training: every `eval_every` steps and after the
last step (not the one before the first step: an untrained model is never the result). The first
of equal figures wins; a non-finite figure never does. Each new best is written as a snapshot,
`<run dir>/checkpoints/best/` (the weights alone; resume and replay never read it), and at the end
of the run the trainer rebuilds its engine from it when an earlier evaluation was the best, so the
test split, `final/` and the summary are the best weights', bitwise those of a run stopped at that
step. What a run remembers of its best is its metrics.jsonl: resume reads the best from there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..state.snapshots import snapshots_dir
from ..telemetry.jsonl import read_jsonl

BEST_FOLDER = "best"  # beside the step-N snapshots, under a name their listing does not match


@dataclass
class Best:
    """A candidate evaluation: its step and its metrics (`Evaluator.run`'s result)."""

    step: int
    result: dict[str, Any]


class BestValidation:
    """Which validation evaluation of training is the best so far, by `metric` (None: keep_best off)."""

    def __init__(self, metric: str | None, run_dir: Path):
        self.metric, self.run_dir = metric, Path(run_dir)
        self.best: Best | None = None

    @property
    def enabled(self) -> bool:
        return self.metric is not None

    @property
    def path(self) -> Path:
        """Where the best evaluation's weights are written."""
        return snapshots_dir(self.run_dir) / BEST_FOLDER

    def check_task(self, task) -> None:
        """The metric is one the task's validation reports; raises ConfigError naming the fix."""
        if not self.enabled:
            return
        generation, decodes = not task.scores_candidates, task.decodes
        has = {"loss": True, "accuracy": not generation or decodes, "f1": decodes}
        if not has[self.metric]:
            offered = [m for m in ("accuracy", "f1", "loss") if has[m]]
            raise ConfigError(f"keep_best={self.metric}: task {task.name}'s validation reports no {self.metric} "
                              f"({'language modelling on whole texts' if generation else 'it scores candidates'}); "
                              f"use keep_best={' or keep_best='.join(offered)}")

    def value(self, result: dict[str, Any]) -> float:
        """The figure that ranks an evaluation, larger better (the loss negated); -inf where missing."""
        figure = result.get(self.metric) if result.get("examples") else None
        if figure is None or not math.isfinite(figure):
            return -math.inf
        return -figure if self.metric == "loss" else figure

    def offer(self, step: int, result: dict[str, Any]) -> bool:
        """Whether the evaluation of `step` is the new best (it is then remembered)."""
        if not self.enabled or step <= 0 or self.value(result) == -math.inf:
            return False
        if self.best is not None and self.value(result) <= self.value(self.best.result):
            return False
        self.best = Best(step, dict(result))
        return True

    def read_logs(self, up_to: int) -> set[int]:
        """Resume: the best of the validation evaluations metrics.jsonl records up to step `up_to`;
        returns the steps that were evaluated."""
        self.best, evaluated = None, set()
        for r in read_jsonl(self.run_dir / "metrics.jsonl"):
            if r.get("type") == "eval" and r.get("split") == "validation" and 0 < r["step"] <= up_to:
                evaluated.add(r["step"])
                self.offer(r["step"], {k: v for k, v in r.items() if k not in ("type", "time", "mesh", "step",
                                                                                 "split", "eval_time_s")})
        return evaluated

    def describe(self) -> str:
        """The best so far, as text (for the log)."""
        if self.best is None:
            return "none"
        figure = self.best.result[self.metric]
        return f"validation {self.metric} {figure:.4f} at step {self.best.step}"
