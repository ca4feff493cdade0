"""An estimator of your own in one file: MeZO's SPSA with each projected gradient clipped.

A ZO estimate g_k = (L(theta + eps z_k) - L(theta - eps z_k)) / (2 eps) is a finite difference of two
noisy losses, and one outlier batch can make it huge; clipping |g_k| to `clip` bounds the step any one
direction can take (as gradient clipping does for first-order training). Everything else is MeZO's:
the same probes, the same directions, so every engine mode and mesh runs it.

    DISTZO_PLUGINS=examples/plugins/clipped_spsa.py python -m distzo train estimator=clipped_spsa estimator.clip=5

The registry makes `estimator=clipped_spsa` a Hydra config group option with the settings below
(`estimator.clip`, checked against its range), a field of ZOArguments (`ZOArguments(estimator=
"clipped_spsa", clip=5.0)`) and a row of the docs' settings tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distzo.config.schema import EstimatorSettings, setting
from distzo.registry import register
from distzo.zo.estimators import SPSA, StepResult


@register("estimator", "clipped_spsa")
class ClippedSPSA(SPSA):
    @dataclass
    class Settings(EstimatorSettings):
        clip: float = setting(10.0, "> 0", "the largest |g_k| a step applies; larger estimates are clipped to it")

    def __init__(self, eps: float = 1e-3, q: int = 1, difference: str = "central", clip: float = 10.0):
        super().__init__(eps=eps, q=q, difference=difference)
        self.clip = float(clip)

    @classmethod
    def from_settings(cls, s: Settings) -> ClippedSPSA:
        return cls(eps=s.eps, q=s.q, difference=str(s.difference), clip=s.clip)

    def combine(self, losses: torch.Tensor) -> StepResult:
        result = super().combine(losses)
        g = tuple(max(-self.clip, min(self.clip, gk)) for gk in result.grads)
        return StepResult(result.loss, g, tuple((k, gk / self.q) for k, gk in enumerate(g)))
