"""Zeroth-order gradient estimators, chosen with `estimator=<name>`."""

from ...config.schema import EstimatorConfig
from .agzo import AGZO
from .base import CLEAN, Estimator, Probe, StepResult
from .prge import PRGE
from .spsa import SPSA

ESTIMATORS: dict[str, type[Estimator]] = {cls.name: cls for cls in (SPSA, PRGE, AGZO)}


def estimator_type(name: str) -> type[Estimator]:
    """The estimator class of `estimator=<name>`."""
    return ESTIMATORS[str(name)]


def build_estimator(cfg: EstimatorConfig) -> Estimator:
    """The estimator an `estimator` config group describes."""
    return estimator_type(cfg.name).from_config(cfg)


__all__ = ["AGZO", "CLEAN", "ESTIMATORS", "Estimator", "Probe", "PRGE", "StepResult", "SPSA",
           "build_estimator", "estimator_type"]
