"""Zeroth-order gradient estimators, chosen with `estimator=<name>`."""

from .agzo import AGZO
from .base import CLEAN, Estimator, Evaluation, StepResult
from .prge import PRGE
from .spsa import SPSA


def build_estimator(cfg) -> Estimator:
    if cfg.name == "mezo":
        return SPSA(eps=cfg.eps, q=cfg.q, difference=cfg.difference)
    if cfg.name == "prge":
        return PRGE(eps=cfg.eps, q=cfg.q)
    if cfg.name == "agzo":
        return AGZO(eps=cfg.eps, q=cfg.q, rank=cfg.agzo.rank, power_iters=cfg.agzo.power_iters)
    raise ValueError(f"unknown estimator {cfg.name!r}")


__all__ = ["AGZO", "CLEAN", "Estimator", "Evaluation", "PRGE", "StepResult", "SPSA", "build_estimator"]
