"""`keep_best`: the weights of a run's best validation evaluation become its result (MeZO's protocol,
transformers' `load_best_model_at_end`), not the last step's.

The candidates are the validation evaluations of training: every `eval_every` steps and after the
last step (not the one before the first step: an untrained model is never the result). The first
of equal figures wins; a non-finite figure never does. Each new best is written as a snapshot,
`<run dir>/checkpoints/best/` (the weights alone; resume and replay never start from it), and at
the end of the run the trainer rebuilds its engine from it when an earlier evaluation was the best,
so the test split, `final/` and the summary are the best weights': bitwise the weights after that
step. What a run remembers of its best is its metrics.jsonl: resume reads the best from there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..state.resume import ResumeError
from ..state.snapshots import CorruptSnapshot, copy_snapshot_weights, snapshots_dir, verify_snapshot
from ..telemetry.jsonl import read_jsonl

BEST_FOLDER = "best"  # beside the step-N snapshots, under a name their listing does not match


class BestWeightsGone(ResumeError):
    """The best evaluation's weights are neither in best/ nor in a snapshot of its step."""

    def __init__(self, step: int, evaluated: set[int], message: str):
        super().__init__(message)
        self.step, self.evaluated = step, evaluated

    def __reduce__(self):  # as its constructor takes it (an exception pickles its args alone)
        return type(self), (self.step, self.evaluated, str(self))


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
            if (r.get("type") == "eval" and r.get("split") == "validation" and 0 < r["step"] <= up_to
                    and "weights_step" not in r):  # not an evaluation of a restored best's weights
                evaluated.add(r["step"])
                self.offer(r["step"], {k: v for k, v in r.items() if k not in ("type", "time", "mesh", "step",
                                                                                 "split", "eval_time_s")})
        return evaluated

    def held(self) -> int | str:
        """The step whose weights best/ holds (verified); else what it holds, as text."""
        return verified_step(self.path)

    def plan_resume(self, up_to: int) -> tuple[set[int], bool, str | None]:
        """Resume (rank 0, before anything is built or cut): the best of the validation evaluations
        metrics.jsonl records up to step `up_to`, where the run continues. Returns the steps evaluated;
        whether the best's weights are to be written once that step's are current (the best is that
        step: the interruption came while writing them); and where best/ does not hold the best, the
        run's own snapshot of that step to copy there (once the run has started: `adopt`). Failing
        those, BestWeightsGone names the cause (the trainer then rebuilds them by re-applying the
        logged steps where it can)."""
        evaluated = self.read_logs(up_to)
        if self.best is None:
            return evaluated, False, None
        step, held = self.best.step, self.held()
        if held == step:
            return evaluated, False, None
        if step == up_to:
            return evaluated, True, None
        kept = snapshots_dir(self.run_dir) / f"step-{step:08d}"
        if verified_step(kept) == step:
            return evaluated, False, str(kept)
        if held == "nothing":
            cause = "there is no checkpoints/best/: the run was started without keep_best, or it was removed"
        elif isinstance(held, int) and held > up_to:
            cause = (f"the run continues from step {up_to} (the newest point it can continue from), before the step "
                     f"{held} that checkpoints/best/ holds, and keeps no snapshot of step {step}")
        else:
            cause = f"checkpoints/best/ holds {f'step {held}' if isinstance(held, int) else held}"
        raise BestWeightsGone(step, evaluated, f"keep_best={self.metric}: the best evaluation up to step {up_to}, "
                                    f"{self.describe()}, has no weights left: {cause}")

    def adopt(self, snapshot: str) -> None:
        """best/ from the weights of one of the run's snapshots (`plan_resume`'s; rank 0)."""
        copy_snapshot_weights(Path(snapshot), self.path)

    def describe(self) -> str:
        """The best so far, as text (for the log)."""
        if self.best is None:
            return "none"
        figure = self.best.result[self.metric]
        return f"validation {self.metric} {figure:.4f} at step {self.best.step}"


def verified_step(folder: Path) -> int | str:
    """The step of the snapshot in `folder`, verified (`verify_snapshot`); else what the folder holds,
    as text. Never raises: ranks wait on what rank 0 finds."""
    if not (folder / "state.json").exists():
        return "nothing"
    try:
        return int(verify_snapshot(folder)["step"])
    except CorruptSnapshot as exc:
        return f"a corrupt snapshot ({exc})"
    except Exception as exc:  # a state.json of another shape
        return f"an unreadable snapshot ({type(exc).__name__}: {exc})"
