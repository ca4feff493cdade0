"""MeZO's Algorithm 1 as its paper publishes it: the baseline `bench` times distzo's step against.

One global RNG seeded with the step's seed; each parameter perturbed in place, in order, by
eps * z drawn from it (theta + eps z), then by -2 eps z (theta - eps z), then restored; the update
regenerates the same z a fourth time. Four passes of Gaussian noise over the weights, where distzo's
step makes two (docs/performance.md). Kept apart from distzo's own step, which never perturbs in place
(invariant I3) and never threads a global RNG.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


@torch.no_grad()
def _perturb(params: Sequence[torch.Tensor], seed: int, scale: float) -> None:
    """theta_i <- theta_i + scale * z_i, in place, z drawn in order from the global RNG seeded with `seed`."""
    torch.manual_seed(seed)
    for p in params:
        z = torch.normal(mean=0, std=1, size=p.size(), device=p.device, dtype=p.dtype)
        p.add_(z, alpha=scale)


def mezo_step(params: Sequence[torch.Tensor], loss: Callable[[], float], lr: float, eps: float, seed: int) -> float:
    """One step of Algorithm 1 on `params` (in place); `loss` evaluates the model as it is. Returns
    the projected gradient."""
    _perturb(params, seed, eps)
    plus = loss()
    _perturb(params, seed, -2 * eps)
    minus = loss()
    _perturb(params, seed, eps)
    g = (plus - minus) / (2 * eps)
    _perturb(params, seed, -lr * g)
    return g
