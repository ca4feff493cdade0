"""Objectives turn label-word logits into per-evaluation (loss sum, example count) pairs:
cross-entropy (`objective=loss`) or minus accuracy (`objective=accuracy`).

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


def minus_accuracy_sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits [E, B, C], labels [B] -> [E, 2] float64: (minus the number of correct predictions, B).
    The non-differentiable objective of MeZO §3.3: ZO needs only the value, so it can minimise
    -accuracy directly."""
    E, B, _ = logits.shape
    correct = (logits.argmax(dim=-1) == labels.to(logits.device)[None]).double().sum(dim=1)
    return torch.stack([-correct, torch.full_like(correct, float(B))], dim=1)


def objective_sums(logits: torch.Tensor, labels: torch.Tensor, objective: str = "loss") -> torch.Tensor:
    """The training objective's (sum, count) per evaluation: `loss` (cross-entropy) or `accuracy`."""
    if objective == "accuracy":
        return minus_accuracy_sums(logits, labels)
    return cross_entropy_sums(logits, labels)


def accuracy_counts(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """logits [B, C] -> (correct, total)."""
    return int((logits.argmax(dim=-1) == labels).sum()), int(labels.numel())
