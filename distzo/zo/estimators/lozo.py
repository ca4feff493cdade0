"""LOZO (Chen et al., ICLR 2025): SPSA with low-rank directions U V^T, V lazy (distzo.zo.lowrank).

Every matrix parameter (embeddings included) is perturbed by U_{t,k} V_j^T: U [rows, r] drawn every
step, V [row elements, r] every `lazy_interval` steps; one-dimensional parameters by MeZO's dense z.
The estimate is MeZO's, g_k = (L(theta + eps z_k) - L(theta - eps z_k)) / (2 eps), the update
theta -= lr (1/q) sum_k g_k U_k V^T, applied chunk by chunk from the factors (the matrix U V^T is never
formed). As the authors' code, no 1/r: each element's perturbation has standard deviation sqrt(r) eps,
so their scripts' learning rates are the paper's divided by r (lr 1e-6 or 1e-7 for OPT-13B, eps 1e-3,
r 1-2, interval 50-100; RoBERTa-large: r 4, interval 50).

`factor_momentum` > 0 is LOZO-M: the weights move along M V^T, M a momentum of the estimates' factors carried
into each new V's row space (its m x r state per matrix, and a dense buffer per vector, rides in
snapshots). The authors' code draws a different U for the update than for the probes on the step
that renews V; here U and V are keyed by their counters, so the update always uses the probes' U.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config.schema import Config, Distribution, EstimatorSettings, setting
from ...errors import ConfigError
from ...registry import register, registry
from ..lowrank import LowRankDirections, LowRankRule
from ..params import TrainableParams
from .spsa import SPSA


@register("estimator", "lozo")
class LOZO(SPSA):
    @dataclass
    class Settings(EstimatorSettings):
        rank: int = setting(2, ">= 1", "r: columns of each matrix's factors U and V")
        lazy_interval: int = setting(50, ">= 1", "steps between draws of V (ν)")
        factor_momentum: float = setting(0.0, ">= 0 and < 1", "LOZO-M's momentum of the factor U (β; 0: plain "
                                         "LOZO)")
        distribution: Distribution = setting(Distribution.gaussian, doc="gaussian only: the factors U and V are "
                                             "Gaussian")

    def __init__(self, eps: float = 1e-3, q: int = 1, difference: str = "central", rank: int = 2,
                 lazy_interval: int = 50, factor_momentum: float = 0.0):
        super().__init__(eps=eps, q=q, difference=difference)
        self.rank, self.lazy_interval, self.factor_momentum = int(rank), int(lazy_interval), float(factor_momentum)

    @classmethod
    def from_settings(cls, s: Settings) -> LOZO:
        return cls(eps=s.eps, q=s.q, difference=str(s.difference), rank=s.rank, lazy_interval=s.lazy_interval,
                   factor_momentum=s.factor_momentum)

    @classmethod
    def check(cls, cfg: Config) -> None:
        super().check(cfg)
        if cfg.estimator.distribution != Distribution.gaussian:
            raise ConfigError(f"estimator={cls.name} draws Gaussian factors; it needs estimator.distribution=gaussian")
        rule = registry("optimizer").get(cfg.optim.name)
        if cfg.estimator.factor_momentum > 0 and (rule.slots or not rule.lr_terms):
            raise ConfigError(f"estimator.factor_momentum={cfg.estimator.factor_momentum} is LOZO-M, whose momentum of "
                              f"the factor replaces the optimizer's; optim={cfg.optim.name} keeps its own state or "
                              "takes signs: use optim=sgd, or estimator.factor_momentum=0")

    def directions(self, seed: int, distribution: str, device, params: TrainableParams, **kwargs) -> LowRankDirections:
        return LowRankDirections(seed, distribution, device, params=params,
                                 rule=LowRankRule(False, self.rank, self.lazy_interval), momentum=self.factor_momentum,
                                 **kwargs)
