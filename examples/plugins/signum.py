"""An optimizer of your own in one file: Signum (Bernstein et al. 2018), the sign of a momentum of the
ZO estimate, an element-wise rule with one state slot and one setting.

    m <- beta m + (1 - beta) g;  x <- x decay - lr sign(m)      (g = sum_k c_k z_k, the step's estimate)

    DISTZO_PLUGINS=examples/plugins/signum.py python -m distzo train optim=signum optim.beta=0.95 optim.lr=1e-4

It has no case in the fused CPU kernel, so it runs on torch ops everywhere, on every engine mode
(its state is held where the mode holds the master: node-shared, offloaded beside the host master).
The registry makes `optim=signum` (or `optim.name=signum`) a Hydra config group option with the
settings below, a field of ZOArguments (`optim_beta`) and a row of the docs' settings tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distzo.config.schema import OptimSettings, setting
from distzo.registry import register
from distzo.zo.optimizers import Optimizer, estimate


@register("optimizer", "signum")
class Signum(Optimizer):
    slots = ("momentum",)
    lr_terms = False  # the rule reads the estimate g itself and scales its sign by lr

    @dataclass
    class Settings(OptimSettings):
        beta: float = setting(0.9, ">= 0 and < 1", "the momentum's decay (0: sign SGD)")

    def constants(self, step: int, lr: float) -> tuple[float, ...]:
        return (self.settings.beta, 1.0 - self.settings.beta, lr)

    def update(self, x, state, terms, decay, constants) -> None:
        beta, one_minus_beta, lr = constants
        (m,) = state
        m.mul_(beta).add_(estimate(terms, x) * one_minus_beta)
        if decay is not None:
            x.mul_(decay)
        torch.where(m > 0, x - lr, torch.where(m < 0, x + lr, x), out=x)

    def describe(self) -> str:
        return f"signum (beta {self.settings.beta:g})"
