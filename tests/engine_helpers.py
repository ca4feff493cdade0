"""Small adapters from the engine interface to what the engine tests compare: logit tensors."""

from __future__ import annotations

import torch

from distzo.data.batches import Batch, label_word_batch
from distzo.zo.directions import Directions


def label_batch(sequences, labels, label_ids) -> Batch:
    """A single-token label-word batch (one scored position per prompt, its last token)."""
    return label_word_batch(sequences, torch.as_tensor(labels), torch.as_tensor(label_ids))


def plan_logits(engine, batch: Batch, plan, step: int) -> torch.Tensor:
    """[len(plan), B, C]: the label-word logits of every evaluation of the plan (all run on this
    process: a 1x1 mesh)."""
    scores = engine.run_probes(batch, plan, step)
    return torch.stack([scores[i].logits for i in range(len(plan))])


def clean_logits(engine, batch: Batch) -> torch.Tensor:
    """[B, C] at the master weights (pending updates applied first)."""
    with engine.materialized() as weights:
        return weights.score(batch).logits


def materialize(engine) -> None:
    """Apply whatever update the engine still awaits."""
    with engine.materialized():
        pass


class PreDrawnDirections(Directions):
    """The same z, drawn into memory as a low-rank rule's is (no stream for the fused pass), so a pass
    takes value slots: the kernels' multi-call path."""

    def stream(self, step, query, ref, scale=1.0):
        return None
