"""AGZO (Lin et al. 2026): activation-guided subspace perturbations, one-sided differences.

Plan: one clean probe f0, then q perturbed ones f_k = L(theta + eps Delta_k) on the same
batch. For the weight of a linear layer Delta_k = R_k A^T, A the top-r basis of that layer's input
activations in the clean forward (`distzo.zo.subspace`); every other trainable parameter gets a
dense Gaussian. g_k = (f_k - f0) / eps and theta -= lr * (1/q) sum_k g_k Delta_k (AGZO Eq. 10 and
Algorithm 2; q = 1 is the paper's algorithm). In expectation the estimate is the gradient projected
onto span(A) (Prop. 5.1).

The clean probe is `shared_clean`: every rank runs it on the whole global batch, so every rank
derives the same bases from the same activations (the exact data-parallel mode, docs/estimators.md);
the q perturbed probes are dealt over the mesh like any other.

The paper restores and updates in one fused pass (W -= (eps + lr g) Delta). Here perturbed weights
are working copies and the master is never perturbed, so there is nothing to restore: the master
receives exactly one write per step, the update (fused into the next step's first pass).

Defaults: r 1 and K 3 as the paper; eps 1e-4 (the paper's 1e-7 is for fp32 models far larger than
the default one). q > 1 draws q independent R (one clean forward, q perturbed ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config.schema import Config, Difference, Distribution, EstimatorSettings, TiedEmbeddings, setting
from ...errors import ConfigError
from ...registry import register
from ..params import TrainableParams
from ..subspace import ActivationCapture, SubspaceDirections
from .base import CLEAN, Estimator, Probe, StepResult


@register("estimator", "agzo")
class AGZO(Estimator):
    shared_clean = True
    replayable = False  # the directions follow each step's activations, not the seed alone
    differences = ("forward",)

    @dataclass
    class Settings(EstimatorSettings):
        eps: float = setting(1e-4, "> 0", "the perturbation scale (eps)")
        difference: Difference = setting(Difference.forward, doc="forward (AGZO is one-sided)")
        rank: int = setting(1, ">= 1", "r: columns of each linear layer's input basis A (the paper's value)")
        power_iters: int = setting(3, ">= 0", "K: block power iterations on the layer's input activations")
        tied_embeddings: TiedEmbeddings = setting(TiedEmbeddings.freeze, doc="a token embedding shared with the "
                                                  "LM head: freeze (not trained) or dense (MeZO's dense Gaussian)")
        distribution: Distribution = setting(Distribution.gaussian, doc="gaussian only: R and the dense directions "
                                             "are Gaussian")

    def __init__(self, eps: float = 1e-4, q: int = 1, rank: int = 1, power_iters: int = 3,
                 tied_embeddings: str = "freeze"):
        self.eps, self.q, self.rank, self.power_iters = float(eps), int(q), int(rank), int(power_iters)
        self.tied_embeddings = tied_embeddings

    @classmethod
    def from_settings(cls, s: Settings) -> AGZO:
        return cls(eps=s.eps, q=s.q, rank=s.rank, power_iters=s.power_iters, tied_embeddings=str(s.tied_embeddings))

    @classmethod
    def check(cls, cfg: Config) -> None:
        if cfg.estimator.difference != "forward":
            raise ConfigError("estimator=agzo is one-sided (AGZO Algorithm 2); it needs estimator.difference=forward")
        if cfg.estimator.distribution != "gaussian":
            raise ConfigError("estimator=agzo draws Gaussian R and dense noise; it needs "
                              "estimator.distribution=gaussian")

    def directions(self, seed: int, distribution: str, device, params: TrainableParams, **kwargs) -> SubspaceDirections:
        return SubspaceDirections(seed, distribution, device, **kwargs)

    def prepare_model(self, model) -> None:
        """The tied-embedding policy `freeze`: a token embedding that is also the LM head trains
        neither as a table (dense noise over every row would swamp the subspace directions'
        advantage) nor as a linear layer (the head is read by label rows, so it has no input
        activations here)."""
        if self.tied_embeddings != "freeze":
            return
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        if head is not None and embed is not None and head.weight is embed.weight:
            embed.weight.requires_grad_(False)

    def activation_capture(self, model, params, directions) -> ActivationCapture:
        return ActivationCapture(model, params, directions, self.rank, self.power_iters)

    def plan(self) -> list[Probe]:
        return [Probe(CLEAN, 0)] + [Probe(k, +1) for k in range(self.q)]

    def combine(self, losses: torch.Tensor) -> StepResult:
        losses = losses.double()
        clean, plus = losses[0], losses[1:]
        g = tuple(float(x) for x in (plus - clean) / self.eps)
        return StepResult(float(clean), g, tuple((k, gk / self.q) for k, gk in enumerate(g)))
