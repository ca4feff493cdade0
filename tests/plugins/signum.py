"""A test-only optimizer added in one file, as a user adds one: Signum (the sign of a momentum of the
estimate; Bernstein et al. 2018), an element-wise rule with one state slot, no settings and no case
in the fused CPU kernel (it runs on torch ops everywhere). `DISTZO_PLUGINS=tests.plugins.signum`
makes `optim.name=signum` available to every process of a run; tests/unit/test_optimizers.py and the
layout matrix of tests/distributed/test_estimator_layouts.py run it like the built-in rules."""

from __future__ import annotations

from distzo.zo.optimizers import Optimizer, estimate, register

BETA = 0.9


@register
class Signum(Optimizer):
    """m <- beta m + (1 - beta) g; x <- x decay - lr sign(m)."""

    name = "signum"
    slots = ("momentum",)
    lr_terms = False

    def constants(self, step: int, lr: float) -> tuple[float, ...]:
        return (BETA, 1.0 - BETA, lr)

    def update(self, x, state, terms, decay, constants) -> None:
        import torch

        beta, one_minus_beta, lr = constants
        (m,) = state
        m.mul_(beta).add_(estimate(terms, x) * one_minus_beta)
        if decay is not None:
            x.mul_(decay)
        torch.where(m > 0, x - lr, torch.where(m < 0, x + lr, x), out=x)
