"""AGZO (Lin et al. 2026): activation-guided subspace perturbations, one-sided differences.

Plan: one clean evaluation f0, then q perturbed ones f_k = L(theta + eps Delta_k) on the same
batch. For the weight of a linear layer Delta_k = R_k A^T, A the top-r basis of that layer's input
activations in the clean forward (`distzo.zo.subspace`); every other trainable parameter gets a
dense Gaussian. g_k = (f_k - f0) / eps and theta -= lr * (1/q) sum_k g_k Delta_k (AGZO Eq. 10 and
Algorithm 2; q = 1 is the paper's algorithm). In expectation the estimate is the gradient projected
onto span(A) (Prop. 5.1).

The clean evaluation is `shared_clean`: every rank runs it on the whole global batch, so every rank
derives the same bases from the same activations (the exact data-parallel mode, docs/estimators.md);
the q perturbed evaluations are dealt over the mesh like any other.

The paper restores and updates in one fused pass (W -= (eps + lr g) Delta). Here perturbed weights
are working copies and the master is never perturbed, so there is nothing to restore: the master
receives exactly one write per step, the update (fused into the next step's first pass).
"""

from __future__ import annotations

import torch

from .base import CLEAN, Estimator, Evaluation, StepResult


class AGZO(Estimator):
    shared_clean = True

    def __init__(self, eps: float = 1e-4, q: int = 1, rank: int = 1, power_iters: int = 3):
        self.eps, self.q, self.rank, self.power_iters = float(eps), int(q), int(rank), int(power_iters)

    def plan(self) -> list[Evaluation]:
        return [Evaluation(CLEAN, 0)] + [Evaluation(k, +1) for k in range(self.q)]

    def combine(self, losses: torch.Tensor) -> StepResult:
        losses = losses.double()
        clean, plus = losses[0], losses[1:]
        g = tuple(float(x) for x in (plus - clean) / self.eps)
        return StepResult(float(clean), g, tuple((k, gk / self.q) for k, gk in enumerate(g)))
