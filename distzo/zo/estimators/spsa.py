"""SPSA as in MeZO: g_k = (L(theta + eps z_k) - L(theta - eps z_k)) / (2 eps), update (1/q) sum_k g_k z_k.

q = 1 is MeZO's Algorithm 1; q > 1 is n-SPSA (Algorithm 2), all queries on the same batch: scale
optim.lr with q (MeZO appendix A.2). `difference="forward"` uses one clean probe shared by all
queries: g_k = (L(theta + eps z_k) - L(theta)) / eps. Defaults: eps 1e-3, q 1, central, Gaussian z.
"""

from __future__ import annotations

import torch

from ...config.schema import EstimatorSettings
from ...registry import register
from .base import CLEAN, Estimator, Probe, StepResult


@register("estimator", "mezo")
class SPSA(Estimator):
    streams_blocks = True
    decodes = True

    def __init__(self, eps: float = 1e-3, q: int = 1, difference: str = "central"):
        if difference not in ("central", "forward"):
            raise ValueError(f"unknown difference {difference!r}")
        self.eps, self.q, self.difference = float(eps), int(q), difference

    @classmethod
    def from_settings(cls, s: EstimatorSettings) -> SPSA:
        return cls(eps=s.eps, q=s.q, difference=str(s.difference))

    def plan(self) -> list[Probe]:
        if self.difference == "central":
            return [Probe(k, s) for k in range(self.q) for s in (+1, -1)]
        return [Probe(CLEAN, 0)] + [Probe(k, +1) for k in range(self.q)]

    def combine(self, losses: torch.Tensor) -> StepResult:
        losses = losses.double()
        if self.difference == "central":
            plus, minus = losses[0::2], losses[1::2]
            grads = (plus - minus) / (2 * self.eps)
            loss = float(losses.mean())  # (L+ + L-)/2 = L(theta) + O(eps^2)
        else:
            clean, plus = losses[0], losses[1:]
            grads = (plus - clean) / self.eps
            loss = float(clean)
        g = tuple(float(x) for x in grads)
        return StepResult(loss, g, tuple((k, gk / self.q) for k, gk in enumerate(g)))
