"""One pass over one chunk of a master: apply the owed update, then write the step's working copies.

Every path that changes or perturbs weights goes through `chunk_pass`: the update fused into the
next step's perturbation (engine/weights.py), the plain update pass and flushes
(engine/update.py), offloaded blocks on their device slots and slices (engine/offload.py). So
resident, fused, offloaded and sliced runs perform the same floating-point operations on every
element and agree bitwise:

    x = master * (1 - lr wd)                     (parameters with weight decay)
    x = x - (lr c_k) z_k(step - 1)   for each k  (one rounded operation per term, in order)
    master = x
    copy(q, sign) = x + eps z_q(step)  or  x - eps z_q(step)

Two implementations do exactly this. The fused kernels (`distzo.native`, CPU, float32) do it in one
pass over the chunk. torch ops do it in one pass per term and per copy. z is scaled as it is drawn
(the value of z.mul_(scale), see `Directions.fill_chunk`), and subtracting a negative multiple of z
is adding its magnitude, exactly. A master narrower than float32 rounds z to its dtype first.

An optimizer with a rule of its own (`distzo.zo.optimizers.UpdateRule`: momentum, adam, sign) pays
the owed update through that rule instead, on the chunk's master and its state (float32 tensors over
the same elements), in the same pass that writes the copies: `UpdateRule.apply` in torch ops, or
the fused kernel's `distzo_chunk_rule`, which performs the same operations. A master narrower than
float32 is updated in float32 and rounded once. sgd and fzoo take the path above, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from ..native import Kernels, Source
from ..zo.directions import ChunkRef, Directions
from ..zo.optimizers import UpdateRule
from ..zo.params import TrainableParam


@dataclass
class PendingUpdate:
    """An update decided but not yet applied everywhere (I5): theta <- theta (1 - lr wd) -
    sum_k (lr c_k) z_k(step), or the optimizer's `rule` (with state), and the stages that still owe it."""

    step: int
    coefficients: tuple[tuple[int, float], ...]
    lr: float
    weight_decay: float
    stages: set = field(default_factory=set)
    rule: UpdateRule | None = None

    @property
    def terms(self) -> list[tuple[int, float]]:
        """(k, a_k): z_k enters scaled by |a_k| (lr c_k, or c_k for a rule that says so)."""
        if self.rule is not None:
            return [(k, self.rule.term_scale(self.lr, c)) for k, c in self.coefficients if c != 0.0]
        return [(k, self.lr * c) for k, c in self.coefficients if c != 0.0]

# Working copies of one chunk, by query: query -> [(sign, out)], out holding the same elements as master.
Copies = Mapping[int, Sequence[tuple[int, torch.Tensor]]]

# Chunk-sized buffers of drawn z a fused call may hold at once (per thread): the owed term and
# the new query of an SPSA step; more terms or queries take more calls.
VALUE_SLOTS = 2


def chunk_pass(directions: Directions, p: TrainableParam, ref: ChunkRef, master: torch.Tensor,
               pending: PendingUpdate | None = None, step: int = 0, eps: float = 0.0,
               copies: Copies | None = None, part: tuple[int, int] | None = None,
               state: Sequence[torch.Tensor] = ()) -> None:
    """Apply `pending` to one chunk of p held in `master` (in place), then write `copies` of the
    updated values perturbed by eps * z of `step`.

    part=(lo, hi): master holds only elements [lo, hi) of the chunk (a rank's slice of a block ends
    inside a chunk), and so do the copies. Every element receives exactly the operations it would
    in a whole-chunk pass; a Gaussian z is still drawn for the whole chunk (its generator cannot be
    entered in the middle), a Rademacher stream only where needed. state: the optimizer's state
    over the same elements as master (float32, one tensor per slot), read and written by a rule."""
    copies = copies or {}
    kernels = directions.kernels
    rule = pending.rule if pending is not None else None
    if rule is not None and len(state) != rule.slots:
        raise RuntimeError(f"internal error: {p.name} has {len(state)} optimizer state tensors, its rule needs "
                           f"{rule.slots}")
    if (kernels is not None and master.dtype == torch.float32 and p.tensor.dtype == torch.float32
            and master.device.type == "cpu" and master.is_contiguous()
            and all(out.dtype == torch.float32 and out.is_contiguous() for outs in copies.values() for _, out in outs)
            and all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" for t in state)):
        if rule is not None:
            _fused_rule(kernels, directions, p, ref, master, pending, step, eps, copies, part, state)
        else:
            _fused(kernels, directions, p, ref, master, pending, step, eps, copies, part)
    elif rule is not None:
        _torch_ops_rule(directions, p, ref, master, pending, step, eps, copies, part, state)
    else:
        _torch_ops(directions, p, ref, master, pending, step, eps, copies, part)


def _decay(p: TrainableParam, u: PendingUpdate | None) -> float | None:
    return 1.0 - u.lr * u.weight_decay if u is not None and p.decay and u.weight_decay else None


def _torch_ops(directions: Directions, p: TrainableParam, ref: ChunkRef, master: torch.Tensor,
               u: PendingUpdate | None, step: int, eps: float, copies: Copies, part: tuple[int, int] | None) -> None:
    size = ref.stop - ref.start
    window = slice(None) if part is None else slice(*part)
    decay = _decay(p, u)
    if decay is not None:
        master.mul_(decay)
    if u is not None and u.terms:
        fp32 = master.dtype == torch.float32
        z = directions.scratch(size)
        for k, a in u.terms:
            directions.fill_chunk(z, u.step, k, ref, abs(a) if fp32 else 1.0)
            zk = z[window]
            if not fp32:
                master.sub_(zk.to(master.dtype).mul_(a))
            elif a < 0:
                master.add_(zk)
            else:
                master.sub_(zk)
    fp32 = p.tensor.dtype == torch.float32
    for q, outs in copies.items():
        z = directions.fill_chunk(directions.scratch(size), step, q, ref, eps if fp32 else 1.0)
        if not fp32:
            z = z.to(p.tensor.dtype).mul_(eps)
        zq = z[window]
        for sign, out in outs:
            (torch.add if sign > 0 else torch.sub)(master, zq, out=out)


def _torch_ops_rule(directions: Directions, p: TrainableParam, ref: ChunkRef, master: torch.Tensor,
                    u: PendingUpdate, step: int, eps: float, copies: Copies, part: tuple[int, int] | None,
                    state: Sequence[torch.Tensor]) -> None:
    """The optimizer's rule (`UpdateRule.apply`) on the chunk, every term's z drawn into its own
    scratch slot, then the copies as `_torch_ops` writes them."""
    size = ref.stop - ref.start
    window = slice(None) if part is None else slice(*part)
    x = master if master.dtype == torch.float32 else master.to(torch.float32)
    terms = [(directions.fill_chunk(directions.scratch(size, i), u.step, k, ref, abs(a))[window], a < 0)
             for i, (k, a) in enumerate(u.terms)]
    u.rule.apply(x, state, terms, _decay(p, u))
    if x is not master:
        master.copy_(x)
    if copies:
        _torch_ops(directions, p, ref, master, None, step, eps, copies, part)


def _fused_rule(kernels: Kernels, directions: Directions, p: TrainableParam, ref: ChunkRef, master: torch.Tensor,
                u: PendingUpdate, step: int, eps: float, copies: Copies, part: tuple[int, int] | None,
                state: Sequence[torch.Tensor]) -> None:
    """The rule's update and the copies in one kernel call (`Kernels.chunk_rule`): every term at
    once (Gaussian terms each hold a value slot), and the copies whose z still fits in the slots
    (every one for an SPSA step, and always for Rademacher z); any copies left take `_fused`'s
    calls afterwards, reading the updated master."""
    size = ref.stop - ref.start
    slots = 0

    def source(at_step: int, query: int, scale: float) -> Source:
        nonlocal slots
        stream = directions.stream(at_step, query, ref, scale)
        if stream is not None:
            return stream
        slots += 1
        return directions.fill_chunk(directions.scratch(size, slots - 1), at_step, query, ref, scale)

    terms = [(source(u.step, k, abs(a)), a < 0) for k, a in u.terms]
    budget = max(VALUE_SLOTS, slots + 1)
    queries: list[Source] = []
    outs: list[tuple[torch.Tensor, int, int]] = []
    rest = dict(copies)
    for q, qouts in copies.items():
        if slots >= budget and directions.stream(step, q, ref, eps) is None:
            break
        queries.append(source(step, q, eps))
        outs += [(out, len(queries) - 1, sign) for sign, out in qouts]
        del rest[q]
    kernels.chunk_rule(master, u.rule.kind, u.rule.constants, state, part[0] if part is not None else 0,
                       _decay(p, u), terms, queries, outs)
    if rest:
        _fused(kernels, directions, p, ref, master, None, step, eps, rest, part)


def _fused(kernels: Kernels, directions: Directions, p: TrainableParam, ref: ChunkRef, master: torch.Tensor,
           u: PendingUpdate | None, step: int, eps: float, copies: Copies, part: tuple[int, int] | None) -> None:
    """The same pass as `_torch_ops`, in as few kernel calls as the value slots allow: one for an
    SPSA step, and always one for Rademacher z, whose streams need no slot."""
    call = _KernelCall(kernels, master, part[0] if part is not None else 0, _decay(p, u))
    size = ref.stop - ref.start

    def source(at_step: int, query: int, scale: float) -> Source:
        stream = directions.stream(at_step, query, ref, scale)
        if stream is not None:
            return stream
        if call.slots == VALUE_SLOTS:
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
    """The arguments of the next `Kernels.chunk` call, gathered until it runs."""

    def __init__(self, kernels: Kernels, master: torch.Tensor, offset: int, decay: float | None):
        self.kernels, self.master, self.offset, self.decay = kernels, master, offset, decay
        self.terms: list[tuple[Source, bool]] = []
        self.queries: list[Source] = []
        self.outs: list[tuple[torch.Tensor, int, int]] = []
        self.slots = 0  # value slots holding drawn z for this call

    def run(self) -> None:
        if self.decay is not None or self.terms or self.queries:
            self.kernels.chunk(self.master, self.offset, self.decay, self.terms, self.queries, self.outs)
        self.decay = None  # applied once, in the first call
        self.terms, self.queries, self.outs, self.slots = [], [], [], 0
