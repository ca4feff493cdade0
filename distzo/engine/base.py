"""The stage loop every engine shares: stem -> blocks -> final + head, all evaluations per stage.

For each stage the engine draws the stage's z once per query and runs every evaluation of the step
through that stage before moving on, so the + and - passes share one noise generation (ZO2's
"dual forward", generalised to any plan). Engines differ only in where a block's weights are while
it computes (`block_sources`) and when an update reaches them (`update`, `flush`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence

import torch
from torch import nn

from ..data.tasks import Batch
from ..models.adapters import DecoderAdapter
from ..zo.directions import Directions
from ..zo.estimators import CLEAN, Evaluation
from ..zo.params import TrainableParams
from .weights import CleanWeights, PerturbedWeights, StageNoise, Workspace


class StagedEngine:
    """Evaluates a step's plan stage by stage; subclasses place the weights and apply updates."""

    def __init__(self, model: nn.Module, adapter: DecoderAdapter, params: TrainableParams, directions: Directions,
                 row_tokens: int = 1024):
        for p in params:
            if not p.tensor.is_contiguous():
                raise ValueError(f"parameter {p.name} is not contiguous; the chunked update needs flat views")
        self.model, self.adapter, self.params, self.directions = model, adapter, params, directions
        self.device = directions.device
        self.row_tokens = row_tokens
        self.workspace = Workspace(self.device)

    @contextmanager
    def block_sources(self, i: int) -> Iterator[Mapping[str, torch.Tensor] | None]:
        """The tensors holding block i's parameters on the compute device while it computes (None:
        the parameters themselves)."""
        yield None

    def update(self, step: int, coefficients: Sequence[tuple[int, float]], lr: float, weight_decay: float) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Apply any deferred update, so the master weights are current (DESIGN I5)."""

    def transfer_stats(self) -> dict[str, int]:
        """Cumulative bytes moved host-to-device and back (zero when nothing is offloaded)."""
        return {"h2d_bytes": 0, "d2h_bytes": 0}

    @torch.inference_mode()
    def label_logits(self, batch: Batch, label_ids: torch.Tensor, plan: Sequence[Evaluation],
                     step: int, eps: float) -> torch.Tensor:
        """Label-word logits [len(plan), B, C] of every evaluation of the plan on one batch."""
        packed = batch.pack(self.row_tokens).to(self.device)
        label_ids = label_ids.to(self.device)
        ctx = self.adapter.context(packed.input_ids, packed.position_ids)

        def stage_views(sources=None) -> list:
            noise = StageNoise(self.directions, self.workspace, step, eps)
            clean = CleanWeights(self.model, sources)
            return [PerturbedWeights(self.model, self.params, noise, self.workspace, ev, sources) if ev.perturbed
                    else clean for ev in plan]

        hidden = [self.adapter.stem(ctx, w) for w in stage_views()]
        for i in range(len(self.adapter.blocks)):
            with self.block_sources(i) as sources:
                hidden = [self.adapter.block(i, h, ctx, w) for h, w in zip(hidden, stage_views(sources))]
        logits = []
        for h, w in zip(hidden, stage_views()):
            features = self.adapter.final(h[packed.last_row, packed.last_col], w)
            out = self.adapter.head(features, label_ids, w)
            logits.append(out.to(torch.promote_types(out.dtype, torch.float32)))  # >= fp32 for the loss
        return torch.stack(logits)

    def clean_label_logits(self, batch: Batch, label_ids: torch.Tensor) -> torch.Tensor:
        """Label-word logits [B, C] at the master weights (deferred updates applied first)."""
        self.flush()
        return self.label_logits(batch, label_ids, [Evaluation(CLEAN, 0)], step=0, eps=0.0)[0]
