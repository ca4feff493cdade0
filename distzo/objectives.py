"""Objectives turn label-word logits into per-evaluation (loss sum, example count) pairs.

Sums and counts, not means: ranks holding different shards add their pairs, and the ratio is then the
exact mean over the global batch (not a mean of means).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def cross_entropy_sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits [E, B, C], labels [B] -> [E, 2] float64: (sum of per-example cross-entropy, B)."""
    E, B, C = logits.shape
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    per_example = F.cross_entropy(logits.reshape(E * B, C), labels.repeat(E), reduction="none")
    sums = per_example.view(E, B).double().sum(dim=1)
    return torch.stack([sums, torch.full_like(sums, float(B))], dim=1)


def accuracy_counts(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """logits [B, C] -> (correct, total)."""
    return int((logits.argmax(dim=-1) == labels).sum()), int(labels.numel())
