"""What a probe sees as its weights: master tensors, or working copies theta + s * eps * z.

A stage's weights may come from the parameters themselves (resident) or from `sources`, a mapping
from parameter name to the tensor that currently holds it on the compute device (an offloaded
block's slot). Views read a parameter through `source()`, so the same code serves every weight store
(distzo.engine.stores: resident, node-shared, offloaded, sliced, a streamed frozen base).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ..models.adapters import CleanWeights, call_with, full_name, module_sources, parameter_slots
from ..telemetry.timing import DISABLED, Timers
from ..zo.directions import Directions
from ..zo.estimators import Probe
from ..zo.optimizers import Optimizer
from ..zo.params import TrainableParam, TrainableParams
from .chunkpass import chunk_pass
from .pending import PendingUpdate

# Where a parameter's optimizer state is now: one float32 tensor per slot, shaped like the master.
StateOf = Callable[[TrainableParam], Sequence[torch.Tensor]]


class Workspace:
    """Flat buffers reused across stages and steps. Fresh multi-MB tensors would page-fault on every
    first touch; a reused buffer is already mapped. A buffer grows when a request exceeds it (views
    handed out earlier keep the old storage alive, so they stay valid)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def take(self, name: str, start: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (name, dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < start + numel:
            with torch.inference_mode(False):  # an ordinary tensor, usable inside and outside inference mode
                grown = torch.empty(start + numel, dtype=dtype, device=self.device)
            if buf is not None and start:
                grown[:start].copy_(buf[:start])
            self._buffers[key] = buf = grown
        return buf[start:start + numel]

    def carve(self, name: str, shapes: Sequence[torch.Size], dtype: torch.dtype, start: int = 0) -> list[torch.Tensor]:
        """Views of the given shapes laid end to end in buffer `name`, from element `start`."""
        total = sum(int(torch.Size(s).numel()) for s in shapes)
        flat = self.take(name, start, total, dtype)
        out, offset = [], 0
        for s in shapes:
            n = int(torch.Size(s).numel())
            out.append(flat[offset:offset + n].view(s))
            offset += n
        return out


class StageNoise:
    """The perturbed working copies one stage needs, for every probe of the plan at once.

    Dense parameters are perturbed chunk by chunk (`chunk_pass`): the pending update is applied to the
    master chunk and every probe's copy of that chunk (`W + s * eps * z`) is written in the same
    pass, so the master is read once for all signs and z never travels through main memory (a
    per-thread scratch buffer, or no buffer at all with the fused kernels and Rademacher z).
    Embedding-like tables are perturbed by rows where an index reads them (only those rows); a head
    that reads the whole table gets a working copy of it like a dense parameter.

    shaper: an optimizer whose state shapes the directions (HiZOO; None: z as drawn); state_of:
    where the state of a parameter whose copies are built on first use is (the outer stage's)."""

    buffer = "work"  # the workspace buffers of the copies: f"{buffer}{probe index}"

    def __init__(self, directions: Directions, workspace: Workspace, step: int, eps: float,
                 plan: Sequence[Probe], timers: Timers = DISABLED, shaper: Optimizer | None = None,
                 state_of: StateOf | None = None):
        self.directions, self.workspace, self.step, self.eps = directions, workspace, step, eps
        self.plan, self.timers = list(plan), timers
        self.shaper, self.state_of = shaper, state_of
        self._copies: dict[tuple[str, int], torch.Tensor] = {}  # (parameter, probe index) -> copy
        self._used: dict[tuple[int, torch.dtype], int] = {}
        self._rows: dict[tuple[str, int, int | None], tuple[torch.Tensor, ...]] = {}

    def ready(self) -> None:
        """Wait until the copies are complete (a no-op here; divided stages wait for their peers)."""

    def copies(self, entries: Sequence[TrainableParam], index: int,
               source: Callable[[TrainableParam], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Working copies of `entries` for probe plan[index] (built for all probes on first use)."""
        self.ready()
        todo = [p for p in entries if (p.name, index) not in self._copies]
        if todo:
            self.prepare(todo, source)
        return {p.name: self._copies[(p.name, index)] for p in entries}

    def prepare(self, entries: Sequence[TrainableParam], source: Callable[[TrainableParam], torch.Tensor],
                pending: PendingUpdate | None = None, state: StateOf | None = None) -> None:
        """Build every probe's working copies of `entries` in one pass over their chunks, first
        applying `pending` (the previous step's update) to each master chunk: the pending update
        fused with the next perturbation, while the chunk is in cache. state: where each parameter's
        optimizer state is (an optimizer with a rule updates it in the same pass; a shaper's state
        shapes the copies)."""
        state = state if state is not None else self.state_of
        with self.timers("perturb"):
            todo = list(entries)
            out = self._outputs(todo)
            copies = {p.name: [(ev.query, ev.sign, out[(p.name, i)].view(-1)) for i, ev in enumerate(self.plan)
                               if ev.perturbed] for p in todo}
            self._build(lambda: self._perturb_chunks(todo, source, pending, copies, state=state))
            self._copies.update(out)

    def _build(self, passes: Callable[[], None]) -> None:
        """Run the chunk passes (here, at once, on the current stream)."""
        passes()

    def _perturb_chunks(self, todo: Sequence[TrainableParam], source: Callable[[TrainableParam], torch.Tensor],
                        pending: PendingUpdate | None,
                        copies: Mapping[str, Sequence[tuple[int, int, torch.Tensor]]],
                        mine: Callable[[list, Callable], list] | None = None, state: StateOf | None = None) -> None:
        """`chunk_pass` over every chunk of `todo` (those `mine` keeps, when given), largest first on
        the noise threads. copies: parameter -> [(query, sign, flat copy)]."""
        targets = {name: {q: [(sign, flat) for qq, sign, flat in entries if qq == q]
                          for q in sorted({q for q, _, _ in entries})} for name, entries in copies.items()}
        masters = {p.name: source(p).view(-1) for p in todo}
        reads_state = state is not None and (pending is not None or self.shaper is not None)
        states = {p.name: [t.view(-1) for t in state(p)] if reads_state else [] for p in todo}
        # All queries of a chunk (on CUDA a span of chunks) are one item.
        work = [(p, ref) for p in todo for ref, _ in self.directions.units(p.key, p.shape)]
        size = lambda item: item[1].stop - item[1].start  # noqa: E731
        if mine is not None:
            work = mine(work, size)

        def one(item) -> None:  # apply the pending update to the master chunk, then write every copy of it
            p, ref = item
            chunk = slice(ref.start, ref.stop)
            chunk_pass(self.directions, p, ref, masters[p.name][chunk], pending, self.step, self.eps,
                       {q: [(sign, flat[chunk]) for sign, flat in outs] for q, outs in targets[p.name].items()},
                       state=[t[chunk] for t in states[p.name]], shaper=self.shaper)

        self.directions.map(one, work, size)

    def _outputs(self, todo: Sequence[TrainableParam]) -> dict[tuple[str, int], torch.Tensor]:
        """Workspace views for every perturbed probe's copy of every entry of `todo`."""
        out: dict[tuple[str, int], torch.Tensor] = {}
        for i, ev in enumerate(self.plan):
            if not ev.perturbed:
                continue
            for dtype in {p.tensor.dtype for p in todo}:
                group = [p for p in todo if p.tensor.dtype == dtype]
                start = self._used.get((i, dtype), 0)
                views = self.workspace.carve(f"{self.buffer}{i}", [p.shape for p in group], dtype, start)
                self._used[(i, dtype)] = start + sum(v.numel() for v in views)
                out.update({(p.name, i): v for p, v in zip(group, views)})
        return out

    def rows(self, p: TrainableParam, query: int, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(unique rows u, inverse map, eps * z[u]) for the rows an index tensor reads (a whole table
        is a working copy: `copies`)."""
        key = (p.name, query, id(index))
        if key not in self._rows:
            with self.timers("perturb"):
                self._rows[key] = self._draw_rows(p, query, index)
        return self._rows[key][:3]

    def _draw_rows(self, p: TrainableParam, query: int, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        unique, inverse = torch.unique(index, return_inverse=True)
        z = self.directions.rows(p.shape, p.key, self.step, query, unique).view((unique.numel(),) + tuple(p.shape[1:]))
        if self.shaper is not None:  # as the chunk pass shapes a copy: float32, rounded once
            z = self.shaper.perturbation(z.mul(self.eps), [t[unique] for t in self.state_of(p)]).to(p.tensor.dtype)
        else:
            z = z.to(p.tensor.dtype).mul_(self.eps)
        # Holding `index` keeps its id from being reused by another tensor while this entry lives.
        return unique, inverse, z, index


class PerturbedWeights:
    """The WeightView of probe plan[index]: theta + sign * eps * z_query, as working copies."""

    def __init__(self, model: nn.Module, params: TrainableParams, noise: StageNoise, index: int,
                 sources: Mapping[str, torch.Tensor] | None = None):
        self.model, self.params, self.noise, self.index = model, params, noise, index
        self.ev = noise.plan[index]
        self.sources = sources or {}

    def source(self, p: TrainableParam) -> torch.Tensor:
        """Where the master value of p is on the compute device now."""
        return self.sources.get(p.name, p.tensor)

    def rows(self, name: str, index: torch.Tensor | None) -> torch.Tensor:
        p = self.params.get(name)
        if p is None:
            return CleanWeights(self.model, self.sources).rows(name, index)
        if index is None:  # the whole table (a full-vocabulary head): a working copy as `call` makes them, one
            # chunk pass for every probe into the stage's workspace, instead of a float32 z of the whole table
            return self.noise.copies([p], self.index, self.source)[p.name]
        unique, inverse, z = self.noise.rows(p, self.ev.query, index)
        master = self.source(p)[unique]  # the rows read
        h = self.noise.directions.magnitude_threshold(p.key)
        if h is not None:  # Sparse MeZO's mask, as the chunk pass applies it to the copies
            z = torch.where(master.abs() <= h, z, 0.0)
        copy = master + z if self.ev.sign > 0 else master - z
        return copy[inverse]

    def call(self, prefix: str, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        local: dict[str, TrainableParam] = {}
        for rel in parameter_slots(module):
            p = self.params.get(full_name(prefix, rel))
            if p is not None:
                local[rel] = p
        if not local:
            return CleanWeights(self.model, self.sources).call(prefix, module, *args, **kwargs)
        unique = list({p.name: p for p in local.values()}.values())
        working = self.noise.copies(unique, self.index, self.source)
        tensors = module_sources(prefix, module, self.sources)  # frozen parameters of an offloaded block
        tensors.update({rel: working[p.name] for rel, p in local.items()})
        return call_with(module, tensors, args, kwargs)
