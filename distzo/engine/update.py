"""The update: theta <- theta * (1 - lr wd) - sum_k (lr c_k) z_k (or the optimizer's rule, with its
state), deferred and applied chunk by chunk.

The per-chunk arithmetic is `chunkpass.chunk_pass`, shared with the perturbation that the update
is usually fused into, so every path performs the same floating-point operations on every element.
Engines reach this module through one method each (`StagedEngine._pay`, docs/architecture.md#engines).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch

from ..zo.directions import Directions
from ..zo.params import TrainableParam
from .chunkpass import PendingUpdate, chunk_pass


class Target(NamedTuple):
    """Where an owed update reaches one parameter: its master, wherever it lives now (the parameter,
    an offloaded block's device slot).

    window: only flat elements [lo, hi) are updated (a rank's slice of an offloaded block); where it
    cuts a Gaussian chunk, the whole chunk is drawn. delta: a float32 tensor shaped like the master
    that receives the change made to each element (an update transferred at reduced precision to a
    full-precision master). state: the optimizer's state tensors of the parameter where they are
    now (float32, shaped like the master; one per slot of the optimizer, none for sgd)."""

    param: TrainableParam
    tensor: torch.Tensor
    window: tuple[int, int] | None = None
    delta: torch.Tensor | None = None
    state: tuple[torch.Tensor, ...] = ()


def apply_update(directions: Directions, targets: Sequence[Target], u: PendingUpdate,
                 mine: Callable[[list, Callable[[Any], int]], list] | None = None) -> None:
    """Update each target in place.

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
