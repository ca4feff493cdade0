"""Objectives turn an evaluation's `Scores` into (sum, count): the quantity the estimator differences.

How a batch's scores are read depends on what the task scored (`Batch.readout`):

  logits       one unit per example, the label words' logits at the prompt's last token (MeZO's
               classification head for single-token label words): cross-entropy over the label
               words, or minus accuracy;
  likelihoods  one unit per candidate of each example (verbalizers of any length, multiple-choice
               options): a candidate's score is its length-normalised log-likelihood, MeZO's
               option score; cross-entropy over the candidates' scores (MeZO's
               `train_as_classification`), or minus accuracy;
  tokens       teacher forcing: the summed negative log-likelihood of every target token and their
               count (the correct candidate's or the completion's tokens only, prompt excluded), so
               the global loss is the exact token mean over a data-parallel batch.

Sums and counts, not means: ranks holding different shards add their pairs, and the ratio is then the
exact mean over the global batch (not a mean of means). The count is examples for the first two and
tokens for `tokens`.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .batches import Batch, Scores


def cross_entropy_sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits [E, B, C], labels [B] -> [E, 2] float64: (sum of per-example cross-entropy, B)."""
    E, B, C = logits.shape
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    per_example = F.cross_entropy(logits.reshape(E * B, C), labels.repeat(E), reduction="none")
    sums = per_example.view(E, B).double().sum(dim=1)
    return torch.stack([sums, torch.full_like(sums, float(B))], dim=1)


def candidate_scores(scores: Scores, batch: Batch) -> torch.Tensor:
    """[examples, max candidates] float64: each candidate's mean log-likelihood per token (MeZO's
    option score); -inf pads examples with fewer candidates."""
    per_unit = -scores.nll.double().cpu() / scores.count.double().cpu().clamp(min=1.0)
    counts = batch.units_per_example()
    out = torch.full((batch.size, max(counts, default=1)), float("-inf"), dtype=torch.float64)
    start = 0
    for e, n in enumerate(counts):
        out[e, :n] = per_unit[start:start + n]
        start += n
    return out


def class_scores(scores: Scores, batch: Batch) -> torch.Tensor:
    """[examples, candidates]: what a prediction is the argmax of, for `logits` and `likelihoods`."""
    if batch.readout == "logits":
        return scores.logits.cpu()
    return candidate_scores(scores, batch)


def objective_sums(scores: Scores, batch: Batch, objective: str = "loss") -> torch.Tensor:
    """[2] float64: the training objective's (sum, count) for one evaluation of `batch`: `loss` (the
    readout's cross-entropy) or `accuracy` (minus the number correct; not for `tokens`)."""
    if batch.readout == "tokens":
        if objective != "loss":
            raise ValueError(f"objective={objective} needs candidates to compare; teacher forcing has none")
        return torch.stack([scores.nll.double().sum().cpu(), scores.count.double().sum().cpu()])
    logits = class_scores(scores, batch)[None]
    if objective == "accuracy":
        correct = float(correct_predictions(scores, batch).double().sum())
        return torch.tensor([-correct, float(batch.size)], dtype=torch.float64)
    return cross_entropy_sums(logits, batch.labels)[0]


def correct_predictions(scores: Scores, batch: Batch) -> torch.Tensor:
    """[examples] bool: whether each example's best-scoring candidate is a right one (`extra["gold"]`
    when an example has several, as ReCoRD's may; else its label)."""
    predicted = class_scores(scores, batch).argmax(dim=-1)
    gold = batch.extra.get("gold")
    if gold is None:
        return predicted == batch.labels
    return torch.tensor([int(p) in g for p, g in zip(predicted.tolist(), gold)], dtype=torch.bool)


def accuracy_counts(scores: Scores, batch: Batch) -> tuple[int, int]:
    """(correct, total) of the argmax predictions of a classification or multiple-choice batch."""
    return int(correct_predictions(scores, batch).sum()), int(batch.labels.numel())
