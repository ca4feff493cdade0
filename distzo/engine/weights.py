"""What an evaluation sees as its weights: master tensors, or working copies theta + s * eps * z.

A stage's weights may come from the parameters themselves (resident) or from `sources`, a mapping
from parameter name to the tensor that currently holds it on the compute device (an offloaded
block's slot). Views read a parameter through `source()`, so the same code serves both engines.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from ..zo.directions import Directions, chunks_of
from ..zo.estimators import Evaluation
from ..timing import DISABLED, Timers
from .division import WorkDivision
from .update import PendingUpdate, update_chunk
from ..zo.params import TrainableParam, TrainableParams


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
    """The perturbed working copies one stage needs, for every evaluation of the plan at once.

    Dense parameters are perturbed chunk by chunk: a chunk's z is drawn into a small per-thread
    scratch buffer, scaled by eps, and every evaluation's copy of that chunk (`W + s * eps * z`) is
    written at once, so z never travels through main memory and the master is read once for all
    signs. Embedding-like tables are perturbed by rows (only the rows an index reads)."""

    def __init__(self, directions: Directions, workspace: Workspace, step: int, eps: float,
                 plan: Sequence[Evaluation], timers: Timers = DISABLED):
        self.directions, self.workspace, self.step, self.eps = directions, workspace, step, eps
        self.plan, self.timers = list(plan), timers
        self._copies: dict[tuple[str, int], torch.Tensor] = {}  # (parameter, evaluation index) -> copy
        self._used: dict[tuple[int, torch.dtype], int] = {}
        self._rows: dict[tuple[str, int, int], tuple[torch.Tensor, ...]] = {}

    def copies(self, entries: Sequence[TrainableParam], index: int,
               source: Callable[[TrainableParam], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Working copies of `entries` for evaluation plan[index] (built for all evaluations on first use)."""
        todo = [p for p in entries if (p.name, index) not in self._copies]
        if todo:
            self.prepare(todo, source)
        return {p.name: self._copies[(p.name, index)] for p in entries}

    def prepare(self, entries: Sequence[TrainableParam], source: Callable[[TrainableParam], torch.Tensor],
                pending: PendingUpdate | None = None, division: WorkDivision | None = None,
                parity: int = 0, node_queries: Sequence[int] = ()) -> None:
        """Build every evaluation's working copies of `entries` in one pass over their chunks, first
        applying `pending` (the previous step's update) to each master chunk: the deferred update
        fused with the next perturbation, while the chunk is in cache.

        division: the node's ranks share the master; this rank updates and draws z only for the
        chunks it owns (for every query in node_queries), into the node-shared z buffer of this
        parity, and reads everyone's z from there (see engine/division.py)."""
        with self.timers("perturb"):
            if division is None:
                self._build(list(entries), source, pending)
            else:
                self._build_divided(list(entries), source, pending, division, parity, node_queries)

    def _build(self, todo: Sequence[TrainableParam], source: Callable[[TrainableParam], torch.Tensor],
               pending: PendingUpdate | None) -> None:
        perturbed = [(i, ev) for i, ev in enumerate(self.plan) if ev.perturbed]
        out = self._outputs(todo)
        queries = sorted({ev.query for _, ev in perturbed})
        work = [(p, ref) for p in todo for ref in chunks_of(p.key, p.shape)]  # all queries of a chunk: one item
        masters = {p.name: source(p).view(-1) for p in todo}

        def one(item) -> None:
            p, ref = item
            master = masters[p.name][ref.start:ref.stop]
            if pending is not None:
                update_chunk(self.directions, p, ref, master, pending)
            for q in queries:
                z = self.directions.fill_chunk(self.directions.scratch(ref.stop - ref.start), self.step, q, ref)
                z = z.mul_(self.eps) if p.tensor.dtype == torch.float32 else z.to(p.tensor.dtype).mul_(self.eps)
                for i, ev in perturbed:
                    if ev.query == q:
                        op = torch.add if ev.sign > 0 else torch.sub
                        op(master, z, out=out[(p.name, i)].view(-1)[ref.start:ref.stop])

        self.directions.map(one, work)
        self._copies.update(out)

    def _outputs(self, todo: Sequence[TrainableParam]) -> dict[tuple[str, int], torch.Tensor]:
        """Workspace views for every perturbed evaluation's copy of every entry of `todo`."""
        out: dict[tuple[str, int], torch.Tensor] = {}
        for i, ev in enumerate(self.plan):
            if not ev.perturbed:
                continue
            for dtype in {p.tensor.dtype for p in todo}:
                group = [p for p in todo if p.tensor.dtype == dtype]
                start = self._used.get((i, dtype), 0)
                views = self.workspace.carve(f"work{i}", [p.shape for p in group], dtype, start)
                self._used[(i, dtype)] = start + sum(v.numel() for v in views)
                out.update({(p.name, i): v for p, v in zip(group, views)})
        return out

    def _build_divided(self, todo: Sequence[TrainableParam], source: Callable[[TrainableParam], torch.Tensor],
                       pending: PendingUpdate | None, division: WorkDivision, parity: int,
                       node_queries: Sequence[int]) -> None:
        perturbed = [(i, ev) for i, ev in enumerate(self.plan) if ev.perturbed]
        out = self._outputs(todo)
        queries = list(node_queries)
        work = [(p, ref) for p in todo for ref in chunks_of(p.key, p.shape)]
        offsets, total = [], 0
        for _, ref in work:
            offsets.append(total)
            total += ref.stop - ref.start
        # eps * z of every chunk and query, float32 (exact for any narrower parameter dtype)
        zbuf = division.z_buffer(parity, total * len(queries), torch.float32)
        masters = {p.name: source(p).view(-1) for p in todo}
        items = list(zip(work, offsets))

        def draw(item) -> None:  # my chunks: the owed update, then every query's eps * z
            (p, ref), off = item
            n = ref.stop - ref.start
            if pending is not None:
                update_chunk(self.directions, p, ref, masters[p.name][ref.start:ref.stop], pending)
            for qi, q in enumerate(queries):
                z = self.directions.fill_chunk(zbuf[qi * total + off:qi * total + off + n], self.step, q, ref)
                if p.tensor.dtype == torch.float32:
                    z.mul_(self.eps)
                else:
                    z.copy_(z.to(p.tensor.dtype).mul_(self.eps))

        def build(item) -> None:  # every chunk: the copies my evaluations need
            (p, ref), off = item
            n = ref.stop - ref.start
            master = masters[p.name][ref.start:ref.stop]
            for qi, q in enumerate(queries):
                evs = [(i, ev) for i, ev in perturbed if ev.query == q]
                if not evs:
                    continue
                z = zbuf[qi * total + off:qi * total + off + n]
                z = z if p.tensor.dtype == torch.float32 else z.to(p.tensor.dtype)
                for i, ev in evs:
                    op = torch.add if ev.sign > 0 else torch.sub
                    op(master, z, out=out[(p.name, i)].view(-1)[ref.start:ref.stop])

        self.directions.map(draw, division.mine(items, lambda item: item[0][1].stop - item[0][1].start))
        division.barrier()  # every owner's update and z are in shared memory
        self.directions.map(build, items)
        self._copies.update(out)

    def rows(self, p: TrainableParam, query: int, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(unique rows u, inverse map, eps * z[u]) for the rows an index tensor reads."""
        key = (p.name, query, id(index))
        if key not in self._rows:
            with self.timers("perturb"):
                self._rows[key] = self._draw_rows(p, query, index)
        return self._rows[key][:3]

    def _draw_rows(self, p: TrainableParam, query: int, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        unique, inverse = torch.unique(index, return_inverse=True)
        z = self.directions.rows(p.shape, p.key, self.step, query, unique)
        z = z.view((unique.numel(),) + tuple(p.shape[1:])).to(p.tensor.dtype).mul_(self.eps)
        # Holding `index` keeps its id from being reused by another tensor while this entry lives.
        return unique, inverse, z, index


def _module_sources(prefix: str, module: nn.Module, sources: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {rel: sources[f"{prefix}.{rel}"] for rel, _ in module.named_parameters(remove_duplicate=False)
            if f"{prefix}.{rel}" in sources}


class CleanWeights:
    """The master weights, unperturbed (read from `sources` where a stage provides them)."""

    def __init__(self, model: nn.Module, sources: Mapping[str, torch.Tensor] | None = None):
        self.model, self.sources = model, sources or {}

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        table = self.sources[name] if name in self.sources else self.model.get_parameter(name)
        return F.embedding(index, table)

    def call(self, prefix: str, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        local = _module_sources(prefix, module, self.sources)
        if not local:
            return module(*args, **kwargs)
        return functional_call(module, local, args, kwargs, tie_weights=False, strict=False)


class PerturbedWeights:
    """The WeightView of evaluation plan[index]: theta + sign * eps * z_query, as working copies."""

    def __init__(self, model: nn.Module, params: TrainableParams, noise: StageNoise, index: int,
                 sources: Mapping[str, torch.Tensor] | None = None):
        self.model, self.params, self.noise, self.index = model, params, noise, index
        self.ev = noise.plan[index]
        self.sources = sources or {}

    def source(self, p: TrainableParam) -> torch.Tensor:
        """Where the master value of p is on the compute device now."""
        return self.sources.get(p.name, p.tensor)

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        p = self.params.get(name)
        if p is None:
            return CleanWeights(self.model, self.sources).rows(name, index)
        unique, inverse, z = self.noise.rows(p, self.ev.query, index)
        master = self.source(p)[unique]
        return (master + z if self.ev.sign > 0 else master - z)[inverse]

    def call(self, prefix: str, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        local: dict[str, TrainableParam] = {}
        for rel, _ in module.named_parameters(remove_duplicate=False):
            p = self.params.get(f"{prefix}.{rel}")
            if p is not None:
                local[rel] = p
        if not local:
            return CleanWeights(self.model, self.sources).call(prefix, module, *args, **kwargs)
        unique = list({p.name: p for p in local.values()}.values())
        working = self.noise.copies(unique, self.index, self.source)
        tensors = _module_sources(prefix, module, self.sources)  # frozen parameters of an offloaded block
        tensors.update({rel: working[p.name] for rel, p in local.items()})
        return functional_call(module, tensors, args, kwargs, tie_weights=False, strict=False)
