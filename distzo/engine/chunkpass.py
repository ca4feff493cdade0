"""One pass over one chunk of a master: apply the pending update, then write the step's working copies.

Every path that changes or perturbs weights goes through `chunk_pass`: the update fused into the
next step's perturbation (engine/weights.py), the plain update pass and flushes
(StageLoop.update_stage, engine/loop.py), offloaded blocks on their device slots and slices
(engine/offload.py). So resident, fused, offloaded
and sliced runs perform the same floating-point operations on every element and agree bitwise. The
update is the optimizer's rule for the step (`distzo.zo.optimizers.Rule`; sgd's is

    x = master * (1 - lr wd)                     (parameters with weight decay)
    x = x - (lr c_k) z_k(step - 1)   for each k  (one rounded operation per term, in order)
    master = x

and the others are as their classes define), then every copy is written from the updated values:

    copy(q, sign) = x + eps z_q(step)  or  x - eps z_q(step)

With an optimizer whose state shapes the directions (`Optimizer.shapes_directions`: HiZOO), a copy
adds the optimizer's `perturbation` of eps z and the state after the update instead of eps z (in
float32, rounded once to a narrower master's dtype).

Where the directions give a parameter a magnitude mask (Sparse MeZO, `Directions.magnitude_threshold`),
z reaches only the elements with |x| <= h: a term's z where the master held such a value before the
update, a copy's z where the updated value is one (+0 elsewhere, so those elements keep their value).

Three implementations do exactly this. The fused kernel (`distzo.native`, CPU, float32) runs a rule
that has a kernel case in one pass over the chunk; on CUDA a Triton kernel (`distzo.native.cuda`)
runs sgd's rule and a query's copies in one pass, z drawn in registers; torch ops run `Rule.apply`
on the chunk and one pass per copy. A shaper's copies run in its own kernel case on CPU (HiZOO's) and
on torch ops elsewhere. z is scaled as it is drawn (the value of z.mul_(scale), see
`Directions.fill_chunk`), and subtracting a negative multiple of z is adding its magnitude, exactly.
A master narrower than float32 is updated in float32 and rounded once; its copies take z rounded to
its dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from ..native import Kernels, Source
from ..native.cuda import CudaKernels
from ..zo.directions import ChunkRef, Directions
from ..zo.optimizers import SGD, Optimizer, Rule
from ..zo.params import TrainableParam

if TYPE_CHECKING:
    from .pending import PendingUpdate

# Copies only, no update: sgd's rule with no terms and no decay leaves the master as it is.
NO_UPDATE = SGD().rule(0, 0.0, 0.0)


# Working copies of one chunk, by query: query -> [(sign, out)], out holding the same elements as master.
Copies = Mapping[int, Sequence[tuple[int, torch.Tensor]]]

# Chunk-sized buffers of drawn z a fused call may hold at once (per thread), beyond what a rule's
# terms need: the new query of an SPSA step; more queries take more calls.
VALUE_SLOTS = 2


def chunk_pass(directions: Directions, p: TrainableParam, ref: ChunkRef, master: torch.Tensor,
               pending: PendingUpdate | None = None, step: int = 0, eps: float = 0.0,
               copies: Copies | None = None, part: tuple[int, int] | None = None,
               state: Sequence[torch.Tensor] = (), shaper: Optimizer | None = None) -> None:
    """Apply `pending` to one chunk of p held in `master` (in place), then write `copies` of the
    updated values perturbed by eps * z of `step`.

    part=(lo, hi): master holds only elements [lo, hi) of the chunk (a rank's slice of a block ends
    inside a chunk), and so do the copies. Every element receives exactly the operations it would
    in a whole-chunk pass; the fused kernels generate a counter stream only where needed, torch ops
    and a low-rank rule's factors draw the whole chunk's z. state: the optimizer's state
    over the same elements as master (float32, one tensor per slot), read and written by the rule.
    shaper: the optimizer whose state shapes the copies' z (`Optimizer.shapes_directions`); its state
    is then given with or without a pending update."""
    copies = copies or {}
    rule = pending.rule if pending is not None else NO_UPDATE
    if len(state) != (len(shaper.slots) if shaper is not None else rule.slots if pending is not None else 0):
        raise RuntimeError(f"internal error: {p.name} has {len(state)} optimizer state tensors, its rule needs "
                           f"{rule.slots}")
    kernels = directions.kernels
    if shaper is None and isinstance(kernels, CudaKernels) and kernels.handles(directions, p, master, pending, copies,
                                                                               state):
        kernels.chunk_pass(directions, p, ref, master, pending, step, eps, copies, part, _decay(p, pending),
                           _torch_ops)  # CUDA: one Triton launch per query
    elif (isinstance(kernels, Kernels) and (shaper or rule).kernel is not None and master.dtype == torch.float32
            and p.tensor.dtype == torch.float32 and master.device.type == "cpu" and master.is_contiguous()
            and all(out.dtype == torch.float32 and out.is_contiguous() for outs in copies.values() for _, out in outs)
            and all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" for t in state)):
        _fused(kernels, directions, p, ref, master, pending, step, eps, copies, part, state, shaper)
    else:
        _torch_ops(directions, p, ref, master, pending, step, eps, copies, part, state, shaper)


def _decay(p: TrainableParam, u: PendingUpdate | None) -> float | None:
    return 1.0 - u.lr * u.weight_decay if u is not None and p.decay and u.weight_decay else None


def _torch_ops(directions: Directions, p: TrainableParam, ref: ChunkRef, master: torch.Tensor,
               u: PendingUpdate | None, step: int, eps: float, copies: Copies, part: tuple[int, int] | None,
               state: Sequence[torch.Tensor], shaper: Optimizer | None = None) -> None:
    """`Rule.apply` on the chunk (on a float32 copy of a narrower master, rounded once), its terms'
    z drawn into scratch slots (a separable rule's one at a time, into one slot), then each copy."""
    size = ref.stop - ref.start
    window = slice(None) if part is None else slice(*part)
    h = directions.magnitude_threshold(p.key)
    if u is not None:
        keep = master.abs() <= h if h is not None else None  # the mask of the values before the update
        x = master if master.dtype == torch.float32 else master.to(torch.float32)
        decay = _decay(p, u)

        def term(slot: int, k: int, a: float) -> torch.Tensor:
            z = directions.fill_chunk(directions.scratch(size, slot), u.step, k, ref, abs(a))[window]
            return z if keep is None else torch.where(keep, z, 0.0)

        if u.rule.separable:
            for k, a in u.terms:
                u.rule.apply(x, state, [(term(0, k, a), a < 0)], decay)
                decay = None  # applied once, before the first term
            if decay is not None:
                u.rule.apply(x, state, [], decay)
        else:
            u.rule.apply(x, state, [(term(i, k, a), a < 0) for i, (k, a) in enumerate(u.terms)], decay)
        if x is not master:
            master.copy_(x)
    fp32 = p.tensor.dtype == torch.float32
    keep = master.abs() <= h if h is not None and copies else None  # the mask of the updated values
    for q, outs in copies.items():
        if shaper is not None:  # the optimizer's perturbation of eps z, in float32, rounded once
            z = directions.fill_chunk(directions.scratch(size), step, q, ref, eps)[window]
            z = shaper.perturbation(z, state).to(master.dtype)
            zq = z if keep is None else torch.where(keep, z, 0.0)
        else:
            z = directions.fill_chunk(directions.scratch(size), step, q, ref, eps if fp32 else 1.0)
            if not fp32:
                z = z.to(p.tensor.dtype).mul_(eps)
            zq = z[window] if keep is None else torch.where(keep, z[window], 0.0)
        for sign, out in outs:
            (torch.add if sign > 0 else torch.sub)(master, zq, out=out)


def _fused(kernels: Kernels, directions: Directions, p: TrainableParam, ref: ChunkRef, master: torch.Tensor,
           u: PendingUpdate | None, step: int, eps: float, copies: Copies, part: tuple[int, int] | None,
           state: Sequence[torch.Tensor], shaper: Optimizer | None = None) -> None:
    """The same pass as `_torch_ops`, in as few kernel calls as the value slots allow: always one
    where z is a counter stream (the CPU's Gaussian and Rademacher z), which needs no slot. A rule
    that is not separable gets all its terms in its first call (each pre-drawn term, a low-rank
    rule's, holds a slot); a separable one (sgd) may spread them over calls. Copies whose z no
    longer fits follow in calls that only write copies, reading the updated master: sgd's case with
    nothing to apply, or, for a shaper, its own case with no term (which shapes the copies by the
    state and changes nothing)."""
    copies_only = (shaper.rule(0, 0.0, 0.0), state) if shaper is not None else (NO_UPDATE, ())
    rule = u.rule if u is not None else copies_only[0]
    mask = directions.magnitude_threshold(p.key)
    call = _KernelCall(kernels, master, rule, state, part[0] if part is not None else 0, _decay(p, u), mask,
                       copies_only)
    size = ref.stop - ref.start
    budget = VALUE_SLOTS
    # every term in the first call: a rule that is not separable, or a mask read before the update
    if (not rule.separable or mask is not None) and u is not None:
        budget = max(VALUE_SLOTS, sum(directions.stream(u.step, k, ref, abs(a)) is None for k, a in u.terms) + 1)

    def source(at_step: int, query: int, scale: float) -> Source:
        stream = directions.stream(at_step, query, ref, scale)
        if stream is not None:
            return stream
        if call.slots == budget:
            call.run()  # frees the slots
        call.slots += 1
        return directions.fill_chunk(directions.scratch(size, call.slots - 1), at_step, query, ref, scale)

    # Terms before queries, so a call that writes copies has applied every term already. Each source
    # is drawn before the call's lists are touched: drawing may run (and so renew) the call.
    for k, a in (u.terms if u is not None else []):
        z = source(u.step, k, abs(a))
        call.terms.append((z, a < 0))
    for q, outs in copies.items():
        z = source(step, q, eps)
        call.queries.append(z)
        call.outs += [(out, len(call.queries) - 1, sign) for sign, out in outs]
    call.run()


class _KernelCall:
    """The arguments of the next `Kernels.chunk` call, gathered until it runs. The rule's update is
    in the first call; later calls of the pass write copies only (`copies_only`: sgd's rule with
    nothing to apply, or a shaper's case with no term)."""

    def __init__(self, kernels: Kernels, master: torch.Tensor, rule: Rule, state: Sequence[torch.Tensor],
                 offset: int, decay: float | None, mask: float | None = None,
                 copies_only: tuple[Rule, Sequence[torch.Tensor]] = (NO_UPDATE, ())):
        self.kernels, self.master, self.offset, self.mask = kernels, master, offset, mask
        self.rule, self.state, self.decay = rule, state, decay
        self.copies_only = copies_only  # the rule and state of the calls after the update's
        self.terms: list[tuple[Source, bool]] = []
        self.queries: list[Source] = []
        self.outs: list[tuple[torch.Tensor, int, int]] = []
        self.slots = 0  # value slots holding drawn z for this call

    def run(self) -> None:
        if self.rule is not NO_UPDATE or self.decay is not None or self.terms or self.queries:
            mask = {"mask_threshold": self.mask} if self.mask is not None else {}
            self.kernels.chunk(self.master, self.rule.kernel, self.rule.constants, self.state, self.offset,
                               self.decay, self.terms, self.queries, self.outs, **mask)
        if not self.rule.separable:  # its update is done: the rest of the pass writes copies
            self.rule, self.state = self.copies_only
        self.decay = None  # applied once, in the first call
        self.terms, self.queries, self.outs, self.slots = [], [], [], 0
