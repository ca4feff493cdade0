"""What an evaluation sees as its weights: master tensors, or working copies theta + s * eps * z.

A stage's weights may come from the parameters themselves (resident) or from `sources`, a mapping
from parameter name to the tensor that currently holds it on the compute device (an offloaded
block's slot). Views read a parameter through `source()`, so the same code serves both engines.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from ..zo.directions import Directions
from ..zo.estimators import Evaluation
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
    """eps * z for the trainable parameters one stage touches, drawn on first use, once per query."""

    def __init__(self, directions: Directions, workspace: Workspace, step: int, eps: float):
        self.directions, self.workspace, self.step, self.eps = directions, workspace, step, eps
        self._dense: dict[tuple[str, int], torch.Tensor] = {}
        self._used: dict[int, int] = {}
        self._rows: dict[tuple[str, int, int], tuple[torch.Tensor, ...]] = {}

    def dense(self, entries: Sequence[TrainableParam], query: int) -> dict[str, torch.Tensor]:
        todo = [p for p in entries if (p.name, query) not in self._dense]
        if todo:
            start = self._used.get(query, 0)
            views = self.workspace.carve(f"z{query}", [p.shape for p in todo], torch.float32, start)
            self._used[query] = start + sum(v.numel() for v in views)
            self.directions.generate_many([(p.shape, p.key) for p in todo], self.step, query, out=views)
            for p, z in zip(todo, views):
                self._dense[(p.name, query)] = z.mul_(self.eps) if p.tensor.dtype == torch.float32 \
                    else z.to(p.tensor.dtype).mul_(self.eps)
        return {p.name: self._dense[(p.name, query)] for p in entries}

    def rows(self, p: TrainableParam, query: int, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(unique rows u, inverse map, eps * z[u]) for the rows an index tensor reads."""
        key = (p.name, query, id(index))
        if key not in self._rows:
            unique, inverse = torch.unique(index, return_inverse=True)
            z = self.directions.rows(p.shape, p.key, self.step, query, unique)
            z = z.view((unique.numel(),) + tuple(p.shape[1:])).to(p.tensor.dtype).mul_(self.eps)
            # Holding `index` keeps its id from being reused by another tensor while this entry lives.
            self._rows[key] = (unique, inverse, z, index)
        return self._rows[key][:3]


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
    """The WeightView of one evaluation: theta + sign * eps * z_query, as working copies."""

    def __init__(self, model: nn.Module, params: TrainableParams, noise: StageNoise, workspace: Workspace,
                 evaluation: Evaluation, sources: Mapping[str, torch.Tensor] | None = None):
        self.model, self.params, self.noise, self.workspace, self.ev = model, params, noise, workspace, evaluation
        self.sources = sources or {}

    def source(self, p: TrainableParam) -> torch.Tensor:
        """Where the master value of p is on the compute device now."""
        return self.sources.get(p.name, p.tensor)

    def _apply(self, master: torch.Tensor, scaled_z: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        op = torch.add if self.ev.sign > 0 else torch.sub
        return op(master, scaled_z) if out is None else op(master, scaled_z, out=out)

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        p = self.params.get(name)
        if p is None:
            return CleanWeights(self.model, self.sources).rows(name, index)
        unique, inverse, z = self.noise.rows(p, self.ev.query, index)
        return self._apply(self.source(p)[unique], z)[inverse]

    def call(self, prefix: str, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        local: dict[str, TrainableParam] = {}
        for rel, _ in module.named_parameters(remove_duplicate=False):
            p = self.params.get(f"{prefix}.{rel}")
            if p is not None:
                local[rel] = p
        if not local:
            return CleanWeights(self.model, self.sources).call(prefix, module, *args, **kwargs)
        unique = list({p.name: p for p in local.values()}.values())
        scaled = self.noise.dense(unique, self.ev.query)
        # One call runs at a time, so every evaluation reuses the same working-copy buffer.
        buffers = {}
        for dtype in {p.tensor.dtype for p in unique}:
            group = [p for p in unique if p.tensor.dtype == dtype]
            buffers.update(zip((p.name for p in group), self.workspace.carve("work", [p.shape for p in group], dtype)))
        working = {p.name: self._apply(self.source(p), scaled[p.name], out=buffers[p.name]) for p in unique}
        tensors = _module_sources(prefix, module, self.sources)  # frozen parameters of an offloaded block
        tensors.update({rel: working[p.name] for rel, p in local.items()})
        return functional_call(module, tensors, args, kwargs, tie_weights=False, strict=False)
