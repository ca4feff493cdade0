"""The ZO-SGD update: theta <- theta * (1 - lr wd) - sum_k (lr c_k) z_k, deferred and applied chunk by chunk.

The per-chunk arithmetic is `chunkpass.chunk_pass`, shared with the perturbation that the update
is usually fused into, so every path performs the same floating-point operations on every element.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..zo.directions import Directions
from ..zo.params import TrainableParam
from .chunkpass import PendingUpdate, chunk_pass


def apply_update(directions: Directions, targets: Sequence[tuple[TrainableParam, torch.Tensor]], u: PendingUpdate,
                 deltas: Sequence[torch.Tensor] | None = None,
                 windows: Sequence[tuple[int, int]] | None = None,
                 mine: Callable[[list, Callable[[Any], int]], list] | None = None) -> None:
    """Update each target tensor (the master of its parameter, wherever it lives now) in place.

    deltas: optional float32 tensors, one per target, that receive the change made to each
    element (for transferring an update at reduced precision to a full-precision master).
    windows: optional (start, stop) flat element range per target: only those elements are updated
    (a rank's slice of an offloaded block); where one cuts a Gaussian chunk, the whole chunk is drawn.
    mine: keeps the chunks this rank owns among its node's ranks (work division over a node-shared
    master); the caller synchronises the node before anyone reads the result."""
    work = []
    for i, (p, target) in enumerate(targets):
        lo, hi = windows[i] if windows is not None else (0, p.numel())
        for ref, part in directions.units(p.key, p.shape, lo, hi):
            a, b = (ref.start, ref.stop) if part is None else (ref.start + part[0], ref.start + part[1])
            work.append((p, target, None if deltas is None else deltas[i], ref, a, b, part))

    size = lambda item: item[5] - item[4]  # noqa: E731
    if mine is not None:
        work = mine(work, size)

    def one(item) -> None:
        p, target, delta, ref, a, b, part = item
        flat = target.view(-1)[a:b]
        before = None if delta is None else flat.to(torch.float32, copy=True)
        chunk_pass(directions, p, ref, flat, u, part=part)
        if delta is not None:
            torch.sub(flat, before, out=delta.view(-1)[a:b])

    with torch.no_grad():
        directions.map(one, work, size)
