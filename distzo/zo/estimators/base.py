"""The estimator contract (docs/architecture.md#one-step, steps 2 and 5).

An estimator plans the forward evaluations a step needs, then turns their losses into projected
gradients g_k (scalars) and update coefficients: the update is theta -= lr * sum_k c_k z_k with
c_k = weight_k * g_k. It never touches weights or data, so any engine and any mesh can run it.

Two class attributes tell the driver and engine how to run the plan:
  shared_clean  the CLEAN evaluation is run by every rank on the whole global batch (not dealt over
                the mesh): AGZO reads its activations to build the step's directions, which every
                rank needs.
  batched       a rank runs all its evaluations as one forward (P-RGE's inner and outer loop).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

CLEAN = -1  # query index of an unperturbed evaluation


@dataclass(frozen=True)
class Evaluation:
    """One forward pass: weights theta + sign * eps * z_query (sign 0 and query CLEAN: theta itself)."""

    query: int
    sign: int

    @property
    def perturbed(self) -> bool:
        return self.sign != 0


@dataclass(frozen=True)
class StepResult:
    """What one step's losses imply: per-query projected gradients and the update coefficients."""

    loss: float  # the step's training loss estimate (logged)
    grads: tuple[float, ...]  # g_k, one per query
    coefficients: tuple[tuple[int, float], ...]  # (query k, c_k): theta -= lr * sum c_k z_k


class Estimator(ABC):
    eps: float
    shared_clean: bool = False
    batched: bool = False

    @abstractmethod
    def plan(self) -> list[Evaluation]:
        """The evaluations of one step, in a fixed order every rank agrees on."""

    def dealt_plan(self) -> list[Evaluation]:
        """The evaluations dealt over the mesh's perturbation ranks: the plan without a shared clean one."""
        return [ev for ev in self.plan() if not (self.shared_clean and not ev.perturbed)]

    @abstractmethod
    def combine(self, losses: torch.Tensor) -> StepResult:
        """losses[i]: mean loss of plan()[i] over the global batch (float64)."""
