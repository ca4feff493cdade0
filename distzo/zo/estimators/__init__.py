"""Zeroth-order gradient estimators, chosen with `estimator=<name>`: each module of this package
registers one (distzo.registry), with its settings beside its class. A new estimator is one new
module here, or a module of your own named by DISTZO_PLUGINS."""

import importlib
import pkgutil

from ...config.schema import EstimatorSettings
from ...registry import registry
from .base import CLEAN, Estimator, Probe, StepResult

for _module in pkgutil.iter_modules(__path__):  # every estimator module registers itself on import
    importlib.import_module(f"{__name__}.{_module.name}")

from .agzo import AGZO  # noqa: E402 (the registered classes, for direct use)
from .prge import PRGE  # noqa: E402
from .spsa import SPSA  # noqa: E402


def estimator_type(name: str) -> type[Estimator]:
    """The estimator class of `estimator=<name>` (among the built-in ones and DISTZO_PLUGINS')."""
    return registry("estimator").get(name)


def build_estimator(settings: EstimatorSettings) -> Estimator:
    """The estimator the `estimator` section describes."""
    return estimator_type(settings.name).from_settings(settings)


__all__ = ["AGZO", "CLEAN", "Estimator", "Probe", "PRGE", "StepResult", "SPSA", "build_estimator",
           "estimator_type"]
