"""Zeroth-order gradient estimators, chosen with `estimator=<name>`."""

from .base import CLEAN, Estimator, Evaluation, StepResult
from .spsa import SPSA


def build_estimator(cfg) -> Estimator:
    if cfg.name == "mezo":
        return SPSA(eps=cfg.eps, q=cfg.q, difference=cfg.difference)
    raise ValueError(f"unknown estimator {cfg.name!r}")


__all__ = ["CLEAN", "Estimator", "Evaluation", "StepResult", "SPSA", "build_estimator"]
