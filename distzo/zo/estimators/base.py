"""The estimator contract (docs/architecture.md#one-step, steps 2 and 5).

An estimator plans the forward probes a step needs, then turns their losses into projected
gradients g_k (scalars) and update coefficients: the update is theta -= lr * sum_k c_k z_k with
c_k = weight_k * g_k. It never touches weights or data, so any engine and any mesh can run it.

Two class attributes tell the driver and engine how to run the plan:
  shared_clean  the CLEAN probe is run by every rank on the whole global batch (not dealt over
                the mesh): AGZO reads its activations to build the step's directions, which every
                rank needs.
  batched       a rank runs all its probes as one forward (P-RGE's inner and outer loop).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ...config.schema import EstimatorConfig
from ..directions import Directions

CLEAN = -1  # query index of an unperturbed probe


@dataclass(frozen=True)
class Probe:
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
    """Plans a step's probes and turns their losses into projected gradients. What the rest of
    distzo must know of an estimator are these properties, never its name:

    shared_clean: every rank runs a clean forward on the whole global batch each step (AGZO's bases).
    batched: a rank's probes run as one batched forward (P-RGE over stacked LoRA-FA copies).
    replayable: a step's directions are a function of (seed, step) alone, so logged steps can be
      re-applied without data (resume's catch-up, `replay`); not AGZO's, which follow activations.
    streams_blocks: its directions are seeded dense noise over every trainable element, drawn block
      by block, so engines may stream blocks from host memory (offloading) or divide a block's noise
      among a node's ranks (work division).
    decodes: it can train on a decoding objective (f1, exact_match), each probe decoding its answers."""

    name = "?"
    eps: float
    shared_clean: bool = False
    batched: bool = False
    replayable: bool = True
    streams_blocks: bool = False
    decodes: bool = False

    @classmethod
    def from_config(cls, cfg: EstimatorConfig) -> Estimator:
        """The estimator of an `estimator` config group."""
        return cls(eps=cfg.eps, q=cfg.q)

    @classmethod
    def check_config(cls, cfg: EstimatorConfig, peft_method: str) -> None:
        """Settings of the `estimator` group (and the trainable set) this estimator cannot run with:
        raises ConfigError naming the fix."""

    def directions(self, seed: int, distribution: str, device, **kwargs) -> Directions:
        """The directions of a run: seeded dense noise (`distzo.zo.directions`)."""
        return Directions(seed, distribution, device, **kwargs)

    def prepare_model(self, model) -> None:
        """Adjust which parameters train before the trainable set is read (nothing by default)."""

    def activation_capture(self, model, params, directions):
        """What captures the activations a step's directions depend on (None: nothing)."""
        return None

    @abstractmethod
    def plan(self) -> list[Probe]:
        """The probes of one step, in a fixed order every rank agrees on."""

    def dealt_plan(self) -> list[Probe]:
        """The probes dealt over the mesh's perturbation ranks: the plan without a shared clean one."""
        return [ev for ev in self.plan() if not (self.shared_clean and not ev.perturbed)]

    @abstractmethod
    def combine(self, losses: torch.Tensor) -> StepResult:
        """losses[i]: mean loss of plan()[i] over the global batch (float64)."""
