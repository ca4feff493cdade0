"""The ZO-SGD update, chunk by chunk: theta <- theta * (1 - lr wd) - sum_k (lr c_k) z_k.

One function for every engine, so resident, offloaded and (later) sliced runs perform the same
floating-point operations on every element and agree bitwise. Each term is its own rounded
operation (scale z, then subtract), so a chunk's result never depends on how a tensor is split
across threads, ranks or transfers.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..zo.directions import Directions, chunks_of
from ..zo.params import TrainableParam


def apply_update(directions: Directions, targets: Sequence[tuple[TrainableParam, torch.Tensor]], step: int,
                 coefficients: Sequence[tuple[int, float]], lr: float, weight_decay: float,
                 deltas: Sequence[torch.Tensor] | None = None) -> None:
    """Update each target tensor (the master of its parameter, wherever it lives now) in place.

    deltas: optional float32 tensors, one per target, that receive the change made to each
    element (for transferring an update at reduced precision to a full-precision master)."""
    decay = 1.0 - lr * weight_decay
    terms = [(k, lr * c) for k, c in coefficients if c != 0.0]
    work = []
    for i, (p, target) in enumerate(targets):
        work += [(p, target, None if deltas is None else deltas[i], ref) for ref in chunks_of(p.key, p.shape)]

    def one(item) -> None:
        p, target, delta, ref = item
        flat = target.view(-1)[ref.start:ref.stop]
        before = None if delta is None else flat.to(torch.float32, copy=True)
        if p.decay and weight_decay:
            flat.mul_(decay)
        if terms:
            z = directions.scratch(ref.stop - ref.start)
            for k, a in terms:
                directions.fill_chunk(z, step, k, ref)
                flat.sub_(z.to(flat.dtype).mul_(a))
        if delta is not None:
            torch.sub(flat, before, out=delta.view(-1)[ref.start:ref.stop])

    with torch.no_grad():
        directions.map(one, work)
