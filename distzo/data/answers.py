"""Exact match and F1 of a generated answer against the accepted answers (SQuAD's definitions).

Both compare normalised text: lower case, punctuation removed, the articles "a", "an" and "the"
removed, whitespace collapsed. Exact match is 1 when the normalised prediction equals one accepted
answer; F1 is the harmonic mean of the precision and recall of the prediction's tokens (whitespace
words, counted with multiplicity) against an answer's; both take the best over the accepted answers.
An empty answer matches only an empty prediction.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    norm = normalize_answer(prediction)
    return float(any(norm == normalize_answer(a) for a in answers))


def _f1(prediction: str, answer: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(answer).split()
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, answers: Sequence[str]) -> float:
    return max((_f1(prediction, a) for a in answers), default=0.0)
