"""Raw labelled sentences: the bundled movie-review polarity set, and a synthetic cue task for tests.

Splits are a deterministic function of `split_seed` only, never of the run seed or the mesh, so every
run and every rank sees the same train / validation / test partition.
"""

from __future__ import annotations

import gzip
import random
from dataclasses import dataclass
from importlib import resources

from ..errors import ConfigError


@dataclass(frozen=True)
class Example:
    text: str
    label: int


@dataclass
class Splits:
    train: list[Example]
    validation: list[Example]
    test: list[Example]


MR_FILE = "movieReviewSnippets_GroundTruth.txt.gz"
MR_POSITIVE_MAX_ID = 5331  # ids 1..5331 are positive, 5332..10605 negative (Pang & Lee ordering)


def movie_reviews() -> list[Example]:
    """The Rotten Tomatoes sentences (label 1 = positive), in file order. The file has 10,605 lines
    but two sentences appear twice (with the same label); one copy of each is kept, so no sentence
    can sit in two splits: 10,603 examples."""
    raw = resources.files("distzo.data").joinpath("assets", MR_FILE).read_bytes()
    out, seen = [], set()
    for line in gzip.decompress(raw).decode("utf-8").splitlines():
        if not line.strip():
            continue
        ident, _rating, text = line.split("\t", 2)
        text = text.strip()
        if text not in seen:
            seen.add(text)
            out.append(Example(text, 1 if int(ident) <= MR_POSITIVE_MAX_ID else 0))
    return out


# Synthetic task for fast tests on random models: each sentence is filler words followed by one cue
# word; the cue's polarity is the label. A tiny model can learn it (the cue is the last token).
_POSITIVE_CUES = ("good", "nice", "fine", "best", "happy", "love", "fun", "wonderful")
_NEGATIVE_CUES = ("bad", "poor", "worst", "sad", "hate", "boring", "awful", "dull")
_FILLER = ("the", "film", "movie", "plot", "was", "and", "a", "story", "it", "very", "quite", "really")


def synthetic_cue(n: int, seed: int) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        label = rng.randrange(2)
        words = [rng.choice(_FILLER) for _ in range(rng.randint(2, 6))]
        words.append(rng.choice(_POSITIVE_CUES if label else _NEGATIVE_CUES))
        out.append(Example(" ".join(words), label))
    return out


def load_splits(dataset: str, val_size: int, test_size: int, train_size: int | None, split_seed: int,
                num_examples: int = 4000) -> Splits:
    if dataset == "mr-polarity":
        examples = movie_reviews()
    elif dataset == "synthetic-cue":
        examples = synthetic_cue(num_examples, split_seed)
    else:
        raise ValueError(f"unknown dataset {dataset!r}")
    if val_size + test_size >= len(examples):
        raise ConfigError(
            f"task.val_size + task.test_size = {val_size + test_size} leaves no training data "
            f"({dataset} has {len(examples)} examples)"
        )
    order = list(range(len(examples)))
    random.Random(split_seed).shuffle(order)
    shuffled = [examples[i] for i in order]
    test = shuffled[:test_size]
    validation = shuffled[test_size:test_size + val_size]
    train = shuffled[test_size + val_size:]
    if train_size is not None:
        train = train[:train_size]
    return Splits(train, validation, test)
