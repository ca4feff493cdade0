"""The ZO-SGD update, chunk by chunk: theta <- theta * (1 - lr wd) - sum_k (lr c_k) z_k.

One per-chunk function (`update_chunk`) serves every path: the plain update pass, the update fused
into the next step's perturbation, offloaded blocks on their device slots, slices. So resident,
fused, offloaded and sliced runs perform the same floating-point operations on every element and
agree bitwise. Each term is its own rounded operation (scale z, then subtract), so a chunk's
result never depends on how a tensor is split across threads, ranks or transfers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from ..zo.directions import ChunkRef, Directions, chunks_of
from ..zo.params import TrainableParam

if TYPE_CHECKING:
    from .division import WorkDivision


@dataclass
class PendingUpdate:
    """An update decided but not yet applied everywhere (DESIGN I5): which stages still owe it."""

    step: int
    coefficients: tuple[tuple[int, float], ...]
    lr: float
    weight_decay: float
    stages: set = field(default_factory=set)

    @property
    def terms(self) -> list[tuple[int, float]]:
        return [(k, self.lr * c) for k, c in self.coefficients if c != 0.0]


def update_chunk(directions: Directions, p: TrainableParam, ref: ChunkRef, flat: torch.Tensor,
                 u: PendingUpdate, part: tuple[int, int] | None = None) -> None:
    """Apply update u to one chunk of p, held in `flat` (the chunk's elements, wherever they live).

    part=(lo, hi): `flat` holds only elements [lo, hi) of the chunk (a rank's slice of a block ends
    inside a chunk). z is still drawn for the whole chunk (a chunk's stream cannot be entered in the
    middle), and every element receives exactly the operations it would in a whole-chunk update.
    A float32 master takes |lr c_k| folded into the draw (the value of z.mul_(|lr c_k|)), and
    subtracting a negative multiple of z is adding |lr c_k| z, exactly; a narrower master rounds z
    to its dtype first."""
    if p.decay and u.weight_decay:
        flat.mul_(1.0 - u.lr * u.weight_decay)
    terms = u.terms
    if terms:
        fp32 = flat.dtype == torch.float32
        z = directions.scratch(ref.stop - ref.start)
        for k, a in terms:
            directions.fill_chunk(z, u.step, k, ref, abs(a) if fp32 else 1.0)
            zk = z if part is None else z[part[0]:part[1]]
            if not fp32:
                flat.sub_(zk.to(flat.dtype).mul_(a))
            elif a < 0:
                flat.add_(zk)
            else:
                flat.sub_(zk)


def apply_update(directions: Directions, targets: Sequence[tuple[TrainableParam, torch.Tensor]], u: PendingUpdate,
                 deltas: Sequence[torch.Tensor] | None = None,
                 windows: Sequence[tuple[int, int]] | None = None, division: WorkDivision | None = None) -> None:
    """Update each target tensor (the master of its parameter, wherever it lives now) in place.

    deltas: optional float32 tensors, one per target, that receive the change made to each
    element (for transferring an update at reduced precision to a full-precision master).
    windows: optional (start, stop) flat element range per target: only those elements are updated
    (a rank's slice of an offloaded block); each costs whole chunks of noise where it cuts one.
    division: only the chunks this rank owns among its node's ranks (a node-shared master); the
    caller synchronises the node before anyone reads the result."""
    work = []
    for i, (p, target) in enumerate(targets):
        lo, hi = windows[i] if windows is not None else (0, p.numel())
        for ref in chunks_of(p.key, p.shape):
            a, b = max(ref.start, lo), min(ref.stop, hi)
            if a < b:
                part = None if (a, b) == (ref.start, ref.stop) else (a - ref.start, b - ref.start)
                work.append((p, target, None if deltas is None else deltas[i], ref, a, b, part))

    size = lambda item: item[5] - item[4]  # noqa: E731
    if division is not None:
        work = division.mine(work, size)

    def one(item) -> None:
        p, target, delta, ref, a, b, part = item
        flat = target.view(-1)[a:b]
        before = None if delta is None else flat.to(torch.float32, copy=True)
        update_chunk(directions, p, ref, flat, u, part)
        if delta is not None:
            torch.sub(flat, before, out=delta.view(-1)[a:b])

    with torch.no_grad():
        directions.map(one, work, size)
