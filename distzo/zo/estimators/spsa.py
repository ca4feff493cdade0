"""SPSA as in MeZO: g_k = (L(theta + eps z_k) - L(theta - eps z_k)) / (2 eps), update (1/q) sum_k g_k z_k.

q = 1 is MeZO's Algorithm 1; q > 1 is n-SPSA (Algorithm 2), all queries on the same batch: scale
optim.lr with q (MeZO appendix A.2). `difference="forward"` uses one clean probe shared by all
queries: g_k = (L(theta + eps z_k) - L(theta)) / eps. Defaults: eps 1e-3, q 1, central, Gaussian z.
`clean=True` (central only) adds that clean probe to the central plan: its loss is the step's logged
loss, and the second difference gives the curvature along each z_k, (L+ + L- - 2 L(theta)) / (2
eps^2), which HiZOO's optimizer reads (optim.name=hizoo).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config.schema import Config, EstimatorSettings, setting
from ...errors import ConfigError
from ...registry import register
from .base import CLEAN, Estimator, Probe, StepResult


@register("estimator", "mezo")
class SPSA(Estimator):
    streams_blocks = True
    decodes = True

    @dataclass
    class Settings(EstimatorSettings):
        clean: bool = setting(False, doc="central differences plus one clean probe a step (one more forward "
                                         "pass): its loss is the logged loss, and the curvature along z, "
                                         "(L+ + L- - 2 L(θ)) / 2ε², reaches the optimizer (optim.name=hizoo reads it)")

    def __init__(self, eps: float = 1e-3, q: int = 1, difference: str = "central", clean: bool = False):
        if difference not in ("central", "forward"):
            raise ValueError(f"unknown difference {difference!r}")
        if clean and difference != "central":
            raise ValueError("a clean probe is added to central differences only (forward ones have it)")
        self.eps, self.q, self.difference, self.clean = float(eps), int(q), difference, bool(clean)

    @classmethod
    def from_settings(cls, s: EstimatorSettings) -> SPSA:
        return cls(eps=s.eps, q=s.q, difference=str(s.difference), clean=bool(getattr(s, "clean", False)))

    @classmethod
    def check(cls, cfg: Config) -> None:
        super().check(cfg)
        if getattr(cfg.estimator, "clean", False) and str(cfg.estimator.difference) != "central":
            raise ConfigError("estimator.clean=true adds a clean probe to central differences; forward differences "
                              "have one already: drop estimator.clean")

    def plan(self) -> list[Probe]:
        central = [Probe(k, s) for k in range(self.q) for s in (+1, -1)]
        if self.difference == "central":
            return [Probe(CLEAN, 0)] + central if self.clean else central
        return [Probe(CLEAN, 0)] + [Probe(k, +1) for k in range(self.q)]

    def combine(self, losses: torch.Tensor) -> StepResult:
        losses = losses.double()
        curvatures: tuple[float, ...] = ()
        if self.difference == "central":
            clean, pairs = (losses[0], losses[1:]) if self.clean else (None, losses)
            plus, minus = pairs[0::2], pairs[1::2]
            grads = (plus - minus) / (2 * self.eps)
            loss = float(pairs.mean())  # (L+ + L-)/2 = L(theta) + O(eps^2)
            if clean is not None:
                loss = float(clean)
                curvatures = tuple(float(x) for x in (plus + minus - 2 * clean) / (2 * self.eps ** 2))
        else:
            clean, plus = losses[0], losses[1:]
            grads = (plus - clean) / self.eps
            loss = float(clean)
        g = tuple(float(x) for x in grads)
        return StepResult(loss, g, tuple((k, gk / self.q) for k, gk in enumerate(g)), curvatures)
