"""The ZO-SGD update, chunk by chunk: theta <- theta * (1 - lr wd) - sum_k (lr c_k) z_k.

One per-chunk routine (`start_update`, piece by piece; `update_chunk` runs it over a chunk) serves
every path: the plain update pass, the update fused into the next step's perturbation, offloaded
blocks on their device slots, slices. So resident, fused, offloaded and sliced runs perform the
same floating-point operations on every element and agree bitwise. Each term is its own rounded operation (scale z, then subtract), so a chunk's result
never depends on how a tensor is split across threads, ranks or transfers.
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
    middle), and every element receives exactly the operations it would in a whole-chunk update."""
    apply = start_update(directions, p, ref, flat, u, part)
    if apply is not None:
        for start, stop in directions.pieces(ref):
            apply(start, stop)


def start_update(directions: Directions, p: TrainableParam, ref: ChunkRef, flat: torch.Tensor,
                 u: PendingUpdate, part: tuple[int, int] | None = None, first_slot: int = 0):
    """Begin applying u to one chunk held in `flat` (part as in `update_chunk`): weight decay now;
    returns apply(start, stop), to be called for each of `directions.pieces(ref)` in order, which
    draws that piece of every term's z (scratch slots from first_slot) and subtracts it from the
    elements flat holds (None when u has no terms).

    Each term is its own rounded operation on every element, in the same order whatever the
    pieces, so the result does not depend on them. A float32 master takes lr * c_k folded into the
    draw (the same value as z.mul_(lr c_k)); a narrower one rounds z to its dtype first, per term."""
    if p.decay and u.weight_decay:
        flat.mul_(1.0 - u.lr * u.weight_decay)
    terms = u.terms
    if not terms:
        return None
    lo, hi = part if part is not None else (0, ref.stop - ref.start)
    streams = [(a, directions.stream(u.step, k, ref, first_slot + j)) for j, (k, a) in enumerate(terms)]
    fp32 = flat.dtype == torch.float32

    def apply(start: int, stop: int) -> None:
        x, y = max(start, lo), min(stop, hi)  # the piece's elements that flat holds, chunk coordinates
        for a, stream in streams:
            # fp32: |a| z drawn in one pass (a draw's scale is a standard deviation, never negative),
            # and subtracting a z equals adding |a| z exactly. Drawn whole: it advances the stream.
            z = stream.next(stop - start, abs(a) if fp32 else 1.0)
            if x < y:
                zk, target = z[x - start:y - start], flat[x - lo:y - lo]
                if not fp32:
                    target.sub_(zk.to(flat.dtype).mul_(a))
                elif a < 0:
                    target.add_(zk)
                else:
                    target.sub_(zk)

    return apply


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
