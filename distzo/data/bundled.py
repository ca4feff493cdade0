"""Data that ships with distzo: the movie-review polarity sentences (the embedded default task), a
multiple-choice task and long documents built from them, and a synthetic task for tests on random
models.

Each returns records, plain dicts, as a file read by `distzo.data.records` would give them, so
bundled and user data go through the same templates, splits and encoding.
"""

from __future__ import annotations

import gzip
import random
from importlib import resources
from typing import Any

Records = list[dict[str, Any]]

MR_FILE = "movieReviewSnippets_GroundTruth.txt.gz"
MR_POSITIVE_MAX_ID = 5331  # ids 1..5331 are positive, 5332..10605 negative (Pang & Lee ordering)


def movie_reviews() -> Records:
    """The Rotten Tomatoes sentences, `{"sentence", "label"}` (label 1 = positive), in file order.
    The file has 10,605 lines but two sentences appear twice (with the same label); one copy of each
    is kept, so no sentence can sit in two splits: 10,603 records."""
    raw = resources.files("distzo.data").joinpath("assets", MR_FILE).read_bytes()
    out, seen = [], set()
    for line in gzip.decompress(raw).decode("utf-8").splitlines():
        if not line.strip():
            continue
        ident, _rating, text = line.split("\t", 2)
        text = text.strip()
        if text not in seen:
            seen.add(text)
            out.append({"sentence": text, "label": 1 if int(ident) <= MR_POSITIVE_MAX_ID else 0})
    return out


ENDING_WORDS = 3  # words of a review that make its ending
ENDING_CHOICES = 4


def movie_review_endings() -> Records:
    """Multiple choice from the same sentences: which of four endings (a review's last three words)
    completes the review's beginning? `{"context", "endings", "label"}`; the three wrong endings are
    other reviews' (a fixed draw, seed 0), the right one's place is drawn too. Reviews of at least
    eight words only: 9,581 records."""
    sentences = [r["sentence"].split() for r in movie_reviews()]
    sentences = [words for words in sentences if len(words) >= 8]
    endings = [" ".join(words[-ENDING_WORDS:]) for words in sentences]
    rng = random.Random(0)
    out = []
    for i, words in enumerate(sentences):
        others: list[str] = []
        while len(others) < ENDING_CHOICES - 1:
            j = rng.randrange(len(sentences))
            if j != i and endings[j] != endings[i] and endings[j] not in others:
                others.append(endings[j])
        label = rng.randrange(ENDING_CHOICES)
        choices = others[:label] + [endings[i]] + others[label:]
        out.append({"context": " ".join(words[:-ENDING_WORDS]), "endings": choices, "label": label})
    return out


# Synthetic task for fast tests on random models: each sentence is filler words followed by one cue
# word; the cue's polarity is the label. A tiny model can learn it (the cue is the last token).
_POSITIVE_CUES = ("good", "nice", "fine", "best", "happy", "love", "fun", "wonderful")
_NEGATIVE_CUES = ("bad", "poor", "worst", "sad", "hate", "boring", "awful", "dull")
_FILLER = ("the", "film", "movie", "plot", "was", "and", "a", "story", "it", "very", "quite", "really")


def synthetic_cue(n: int, seed: int) -> Records:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        label = rng.randrange(2)
        words = [rng.choice(_FILLER) for _ in range(rng.randint(2, 6))]
        words.append(rng.choice(_POSITIVE_CUES if label else _NEGATIVE_CUES))
        out.append({"sentence": " ".join(words), "label": label})
    return out


# Long texts for language modelling at a fixed sequence length (task=lm-2048): each is movie-review
# sentences drawn with replacement until it has DOCUMENT_WORDS words, more than 2,048 tokens in any
# subword tokenizer (each word is at least one token), so `task.max_tokens` cuts every text to the same
# length. Real text, not random ids: a trained model's loss on it means something.
DOCUMENT_WORDS = 2_400


def review_documents(n: int, seed: int, words: int = DOCUMENT_WORDS) -> Records:
    """`n` texts `{"text"}` of at least `words` words each (a fixed draw per seed)."""
    sentences = [r["sentence"] for r in movie_reviews()]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts, count = [], 0
        while count < words:
            sentence = rng.choice(sentences)
            parts.append(sentence)
            count += len(sentence.split())
        out.append({"text": " ".join(parts)})
    return out


BUNDLED = ("mr-polarity", "mr-endings", "synthetic-cue", "review-documents")
BUNDLED_TEXTS = ("review-documents",)  # texts to model whole (task.kind=generation), no labels


def bundled_records(name: str, num_examples: int, split_seed: int) -> Records:
    if name == "mr-polarity":
        return movie_reviews()
    if name == "mr-endings":
        return movie_review_endings()
    if name == "synthetic-cue":
        return synthetic_cue(num_examples, split_seed)
    if name == "review-documents":
        return review_documents(num_examples, split_seed)
    raise ValueError(f"unknown bundled data set {name!r}")
