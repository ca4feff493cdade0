"""The estimator contract (docs/architecture.md#one-step, steps 2 and 5).

An estimator plans the forward probes a step needs, then turns their losses into projected
gradients g_k (scalars) and update coefficients: the update is theta -= lr * sum_k c_k z_k with
c_k = weight_k * g_k. It never touches weights or data, so any engine and any mesh can run it.

An estimator is registered by name (`@register("estimator", name)`, distzo.registry) and declares
its settings as a dataclass `Settings` beside its class, extending `EstimatorSettings` (eps, q,
difference, distribution) with its own fields and defaults; `estimator=<name>` selects them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ...config.schema import Config, EstimatorSettings
from ...errors import ConfigError
from ..directions import Directions
from ..params import TrainableParams

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
    curvatures: tuple[float, ...] = ()  # per query (L+ + L- - 2 L0) / (2 eps^2), where the plan has L0 (HiZOO)


class Estimator(ABC):
    """Plans a step's probes and turns their losses into projected gradients. What the rest of
    distzo must know of an estimator are these properties, never its name:

    shared_clean: every rank runs a clean forward on the whole global batch each step (AGZO's bases).
    stacked: a rank's probes run as one forward over stacked copies of the trainable weights
      (P-RGE over LoRA-FA's B matrices, distzo.engine.stacked).
    replayable: a step's directions are a function of (seed, step) alone, so logged steps can be
      re-applied without data (resume's catch-up, `replay`); not AGZO's, which follow activations.
    streams_blocks: its directions are seeded dense noise over every trainable element, drawn block
      by block, so engines may stream blocks from host memory (offloading) or divide a block's noise
      among a node's ranks (work division).
    decodes: it can train on a decoding objective (f1, exact_match), each probe decoding its answers.
    differences: the `estimator.difference` values it runs with (central, forward).
    peft_methods: the trainable sets it runs on (None: any); the first is the one ZOTrainer picks
      when none is chosen."""

    name = "?"
    Settings = EstimatorSettings
    eps: float
    shared_clean: bool = False
    stacked: bool = False
    replayable: bool = True
    streams_blocks: bool = False
    decodes: bool = False
    differences: tuple[str, ...] = ("central", "forward")
    peft_methods: tuple[str, ...] | None = None

    @classmethod
    def from_settings(cls, s: EstimatorSettings) -> Estimator:
        """The estimator of an `estimator` section."""
        return cls(eps=s.eps, q=s.q)

    @classmethod
    def check(cls, cfg: Config) -> None:
        """What of a run's configuration this estimator cannot run with: raises ConfigError naming the
        fix. The base checks `differences` and `peft_methods`; an estimator adds its own rules."""
        e, peft = cfg.estimator, str(cfg.peft.method)
        if cls.peft_methods is not None and peft not in cls.peft_methods:
            raise ConfigError(f"estimator={cls.name} trains {' or '.join(f'peft={m}' for m in cls.peft_methods)} only; "
                              f"add peft={cls.peft_methods[0]} (now peft={peft})")
        if str(e.difference) not in cls.differences:
            raise ConfigError(f"estimator={cls.name} needs estimator.difference={cls.differences[0]} (now "
                              f"{e.difference})")

    def directions(self, seed: int, distribution: str, device, params: TrainableParams, **kwargs) -> Directions:
        """The directions of a run: seeded dense noise (`distzo.zo.directions`). params: the trainable
        set, holding the initial weights (a resumed run's snapshot is loaded afterwards)."""
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
