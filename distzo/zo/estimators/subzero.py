"""SubZero (Yu et al., ICCV 2025): SPSA in random low-dimensional subspaces (distzo.zo.lowrank).

Each matrix parameter is perturbed by s U Z V^T: U [rows, r] and V [row elements, r] orthonormal,
renewed every `subspace_interval` steps (T0), Z [r, r] Gaussian each step, s = sqrt(rows * row
elements) / r so that E|z|^2 is a dense Gaussian's; one-dimensional parameters by MeZO's dense z.
Within a window the estimate lies in the span of U and V (a biased projection of the gradient),
renewed with them; over U, V and Z it is unbiased. The authors' defaults: r 8, T0 2000 (their OPT-1.3B
prompt-tuning example: r 24, T0 1000, eps 1e-2). Their code draws U and V from the global RNG without
re-seeding and casts them to fp16; here they are keyed by (seed, window, parameter) and orthonormal in
float64 before rounding to float32, the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config.schema import Config, Distribution, EstimatorSettings, setting
from ...errors import ConfigError
from ...registry import register
from ..lowrank import LowRankDirections, LowRankRule
from ..params import TrainableParams
from .spsa import SPSA


@register("estimator", "subzero")
class SubZero(SPSA):
    @dataclass
    class Settings(EstimatorSettings):
        rank: int = setting(8, ">= 1", "r: the subspaces' dimension")
        subspace_interval: int = setting(2000, ">= 1", "steps between renewals of U and V (T0)")
        distribution: Distribution = setting(Distribution.gaussian, doc="gaussian only: the subspaces and the core "
                                             "are Gaussian")

    def __init__(self, eps: float = 1e-3, q: int = 1, difference: str = "central", rank: int = 8,
                 subspace_interval: int = 2000):
        super().__init__(eps=eps, q=q, difference=difference)
        self.rank, self.subspace_interval = int(rank), int(subspace_interval)

    @classmethod
    def from_settings(cls, s: Settings) -> SubZero:
        return cls(eps=s.eps, q=s.q, difference=str(s.difference), rank=s.rank, subspace_interval=s.subspace_interval)

    @classmethod
    def check(cls, cfg: Config) -> None:
        super().check(cfg)
        if cfg.estimator.distribution != Distribution.gaussian:
            raise ConfigError(f"estimator={cls.name} draws Gaussian subspaces; it needs "
                              "estimator.distribution=gaussian")

    def directions(self, seed: int, distribution: str, device, params: TrainableParams, **kwargs) -> LowRankDirections:
        return LowRankDirections(seed, distribution, device, params=params,
                                 rule=LowRankRule(True, self.rank, self.subspace_interval), **kwargs)
