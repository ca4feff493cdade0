"""`python -m distzo eval`: score a model on a task's split, without training."""

from __future__ import annotations

from ...registry import register
from . import HydraCommand


@register("command", "eval")
class Eval(HydraCommand):
    """score a model (a preset, a local folder, or a run's final/) on a task's split, no training"""

    @classmethod
    def task(cls, cfg, claimed) -> None:
        from hydra.core.hydra_config import HydraConfig

        from ...run.evaluation import evaluate
        from ..hydra_app import run_dir

        evaluate(cfg, run_dir(claimed), overrides=list(HydraConfig.get().overrides.task))
