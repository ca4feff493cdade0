"""The pending update: a step's update, recorded by `apply`, not yet applied to every master.

`Engine.apply` does not touch the weights: it records the step's update (`PendingUpdate`: the
optimizer's rule for the step and the estimator's coefficients) with the stages whose masters still
await it. Each stage's masters receive it later, once, through `StageLoop.update_stage`, the one
place every store reaches: fused into the pass that writes the stage's working copies for the next
step (one pass over the weights instead of two), or in a pass of its own (`apply_pending`) at a
flush, before a clean forward, on a sliced rank's slice, or with `engine.fuse_update=false`. Reading
the weights (`materialized`) first applies whatever is pending (I5).

The per-chunk arithmetic is `chunkpass.chunk_pass`, shared with the perturbation that the update is
usually fused into, so every path performs the same floating-point operations on every element.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch

from ..zo.directions import Directions
from ..zo.optimizers import Rule
from ..zo.params import TrainableParam
from .chunkpass import chunk_pass


class Target(NamedTuple):
    """Where a pending update reaches one parameter: its master, wherever it lives now (the
    parameter, an offloaded block's device slot).

    window: only flat elements [lo, hi) are updated (a rank's slice of an offloaded block); where it
    cuts a chunk whose z is drawn into memory, the whole chunk is drawn. delta: a float32 tensor
    shaped like the master that receives the change made to each element (an update transferred at
    reduced precision to a full-precision master). state: the optimizer's state tensors of the
    parameter where they are now (float32, shaped like the master; one per slot of the optimizer,
    none for sgd)."""

    param: TrainableParam
    tensor: torch.Tensor
    window: tuple[int, int] | None = None
    delta: torch.Tensor | None = None
    state: tuple[torch.Tensor, ...] = ()


@dataclass
class PendingUpdate:
    """The step's update, not yet applied everywhere (I5): the optimizer's rule for the step with the
    estimator's coefficients, and the stages whose masters still await it."""

    step: int
    coefficients: tuple[tuple[int, float], ...]
    lr: float
    weight_decay: float
    rule: Rule
    stages: set = field(default_factory=set)
    directions: Directions | None = None  # whose update_terms decide the terms (None: the rule's own)

    def __post_init__(self) -> None:
        terms = self.rule.terms(self.coefficients)
        if self.directions is not None:
            terms = self.directions.update_terms(self.step, self.coefficients, terms, self.rule.term_scale(1.0))
        self.terms = terms  # (query, a): z_query enters scaled by |a| (lr c_k, or c_k for a rule that says so)

    def awaits(self, stage: Any) -> bool:
        return stage in self.stages


def apply_pending(directions: Directions, targets: Sequence[Target], u: PendingUpdate,
                  mine: Callable[[list, Callable[[Any], int]], list] | None = None) -> None:
    """Apply `u` to each target in place, chunk by chunk on the noise threads, in a pass of its own.

    mine: keeps the chunks this rank owns among its node's ranks (work division over a node-shared
    master); the caller synchronises the node before anyone reads the result."""
    work = []
    for t in targets:
        lo, hi = t.window if t.window is not None else (0, t.param.numel())
        for ref, part in directions.units(t.param.key, t.param.shape, lo, hi):
            a, b = (ref.start, ref.stop) if part is None else (ref.start + part[0], ref.start + part[1])
            work.append((t, ref, a, b, part))

    size = lambda item: item[3] - item[2]  # noqa: E731
    if mine is not None:
        work = mine(work, size)

    def one(item) -> None:
        t, ref, a, b, part = item
        flat = t.tensor.view(-1)[a:b]
        before = None if t.delta is None else flat.to(torch.float32, copy=True)
        chunk_pass(directions, t.param, ref, flat, u, part=part, state=[s.view(-1)[a:b] for s in t.state])
        if t.delta is not None:
            torch.sub(flat, before, out=t.delta.view(-1)[a:b])

    with torch.no_grad():
        directions.map(one, work, size)
