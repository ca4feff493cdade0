"""The resident engine: all weights live on the compute device; a step walks the model stage by stage.

For each stage (stem, each block, final + head) the engine draws the stage's z once per query and
runs every evaluation of the step through that stage before moving on, so the + and - passes share
one noise generation (ZO2's "dual forward", generalised to any plan). Perturbed weights are working
copies (`W_tmp = W + s * eps * z`): the master tensors are changed by the update alone (DESIGN I3),
never by a perturb / restore round trip.

Embedding-like tables are perturbed by rows: the stem needs only the rows of the batch's tokens and
the label head only the label words' rows, so no stage copies a vocabulary-sized matrix. Stage noise
and working copies live in a reused `Workspace` and chunk temporaries in per-thread scratch
buffers, so no step allocates parameter-sized tensors afresh.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from ..data.tasks import Batch
from ..models.adapters import CleanWeights, DecoderAdapter
from ..zo.directions import Directions, chunks_of
from ..zo.estimators import CLEAN, Evaluation
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

    def rows(self, p: TrainableParam, query: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(unique rows u, inverse map, eps * z[u]) for the rows an index tensor reads."""
        key = (p.name, query, id(index))
        if key not in self._rows:
            unique, inverse = torch.unique(index, return_inverse=True)
            z = self.directions.rows(p.shape, p.key, self.step, query, unique)
            z = z.view((unique.numel(),) + tuple(p.shape[1:])).to(p.tensor.dtype).mul_(self.eps)
            # Holding `index` keeps its id from being reused by another tensor while this entry lives.
            self._rows[key] = (unique, inverse, z, index)
        return self._rows[key][:3]


class PerturbedWeights:
    """The WeightView of one evaluation: theta + sign * eps * z_query, as working copies."""

    def __init__(self, model: nn.Module, params: TrainableParams, noise: StageNoise, workspace: Workspace,
                 evaluation: Evaluation):
        self.model, self.params, self.noise, self.workspace, self.ev = model, params, noise, workspace, evaluation

    def _apply(self, master: torch.Tensor, scaled_z: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        op = torch.add if self.ev.sign > 0 else torch.sub
        return op(master, scaled_z) if out is None else op(master, scaled_z, out=out)

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        p = self.params.get(name)
        if p is None:
            return F.embedding(index, self.model.get_parameter(name))
        unique, inverse, z = self.noise.rows(p, self.ev.query, index)
        return self._apply(p.tensor[unique], z)[inverse]

    def call(self, prefix: str, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        local: dict[str, TrainableParam] = {}
        for rel, _ in module.named_parameters(remove_duplicate=False):
            p = self.params.get(f"{prefix}.{rel}")
            if p is not None:
                local[rel] = p
        if not local:
            return module(*args, **kwargs)
        unique = list({p.name: p for p in local.values()}.values())
        scaled = self.noise.dense(unique, self.ev.query)
        # One call runs at a time, so every evaluation reuses the same working-copy buffer.
        buffers = {}
        for dtype in {p.tensor.dtype for p in unique}:
            group = [p for p in unique if p.tensor.dtype == dtype]
            buffers.update(zip((p.name for p in group), self.workspace.carve("work", [p.shape for p in group], dtype)))
        working = {p.name: self._apply(p.tensor, scaled[p.name], out=buffers[p.name]) for p in unique}
        return functional_call(module, {rel: working[p.name] for rel, p in local.items()}, args, kwargs,
                               tie_weights=False, strict=False)


class ResidentEngine:
    """Evaluates a step's plan and applies its update with every weight on one device."""

    def __init__(self, model: nn.Module, adapter: DecoderAdapter, params: TrainableParams, directions: Directions,
                 row_tokens: int = 1024):
        for p in params:
            if not p.tensor.is_contiguous():
                raise ValueError(f"parameter {p.name} is not contiguous; the chunked update needs flat views")
        self.model, self.adapter, self.params, self.directions = model, adapter, params, directions
        self.device = adapter.device
        self.row_tokens = row_tokens
        self.workspace = Workspace(self.device)

    @torch.inference_mode()
    def label_logits(self, batch: Batch, label_ids: torch.Tensor, plan: Sequence[Evaluation],
                     step: int, eps: float) -> torch.Tensor:
        """Label-word logits [len(plan), B, C] of every evaluation of the plan on one batch."""
        packed = batch.pack(self.row_tokens).to(self.device)
        label_ids = label_ids.to(self.device)
        ctx = self.adapter.context(packed.input_ids, packed.position_ids)
        clean = CleanWeights(self.model)

        def stage_views() -> list:
            noise = StageNoise(self.directions, self.workspace, step, eps)
            return [PerturbedWeights(self.model, self.params, noise, self.workspace, ev) if ev.perturbed else clean
                    for ev in plan]

        hidden = [self.adapter.stem(ctx, w) for w in stage_views()]
        for i in range(len(self.adapter.blocks)):
            hidden = [self.adapter.block(i, h, ctx, w) for h, w in zip(hidden, stage_views())]
        logits = []
        for h, w in zip(hidden, stage_views()):
            features = self.adapter.final(h[packed.last_row, packed.last_col], w)
            out = self.adapter.head(features, label_ids, w)
            logits.append(out.to(torch.promote_types(out.dtype, torch.float32)))  # >= fp32 for the loss
        return torch.stack(logits)

    def clean_label_logits(self, batch: Batch, label_ids: torch.Tensor) -> torch.Tensor:
        """Label-word logits [B, C] at the master weights."""
        return self.label_logits(batch, label_ids, [Evaluation(CLEAN, 0)], step=0, eps=0.0)[0]

    @torch.no_grad()
    def update(self, step: int, coefficients: Sequence[tuple[int, float]], lr: float, weight_decay: float) -> None:
        """theta -= lr * (sum_k c_k z_k + weight_decay * theta), chunk by chunk, z regenerated.

        Each term is applied as its own rounded operation (scale z, then subtract) so a chunk's
        result never depends on how the tensor is split across threads, ranks or transfers."""
        decay = 1.0 - lr * weight_decay
        terms = [(k, lr * c) for k, c in coefficients if c != 0.0]

        def one(item) -> None:
            p, ref = item
            flat = p.tensor.view(-1)[ref.start:ref.stop]
            if p.decay and weight_decay:
                flat.mul_(decay)
            if not terms:
                return
            z = self.directions.scratch(ref.stop - ref.start)
            for k, a in terms:
                self.directions.fill_chunk(z, step, k, ref)
                flat.sub_(z.to(flat.dtype).mul_(a))

        self.directions.map(one, [(p, ref) for p in self.params for ref in chunks_of(p.key, p.shape)])
