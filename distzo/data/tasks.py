"""Prompted classification: prompts, label words, padded batches, and the layout-free batch sampler.

A prompt is `template.format(sentence=...)`; the model's next-token logits at the prompt's last
token, restricted to the label words' tokens, are the class scores (MeZO's SST-2 setup: loss =
cross-entropy over the label words' logits, prediction = the highest one).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..config import ConfigError
from .datasets import Splits, load_splits

log = logging.getLogger(__name__)


@dataclass
class Packed:
    """Prompts packed end to end into rows of at most `row_tokens` tokens. Position ids restart at 0
    for every prompt, which transformers' mask helpers turn into a block-causal mask, so no prompt
    sees another and almost no compute is spent on padding. Row tails are filled with a pad segment
    (its own positions, so it is masked off too)."""

    input_ids: torch.Tensor  # [R, T]
    position_ids: torch.Tensor  # [R, T]
    last_row: torch.Tensor  # [B] row of each prompt's last token
    last_col: torch.Tensor  # [B] column of each prompt's last token

    def to(self, device: torch.device) -> "Packed":
        return Packed(self.input_ids.to(device), self.position_ids.to(device), self.last_row.to(device),
                      self.last_col.to(device))


@dataclass
class Batch:
    """Tokenised prompts and labels. Rows are independent: shard() takes any contiguous slice."""

    sequences: list[list[int]]
    labels: torch.Tensor  # [B]
    pad_id: int = 0

    @property
    def size(self) -> int:
        return len(self.sequences)

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def shard(self, index: int, count: int) -> "Batch":
        """The index-th of `count` contiguous shards (sizes differ by at most one)."""
        bounds = shard_bounds(self.size, count)
        lo, hi = bounds[index], bounds[index + 1]
        return Batch(self.sequences[lo:hi], self.labels[lo:hi], self.pad_id)

    def pack(self, row_tokens: int = 1024) -> Packed:
        rows: list[list[list[int]]] = [[]]
        used = 0
        for seq in self.sequences:
            if rows[-1] and used + len(seq) > row_tokens:
                rows.append([])
                used = 0
            rows[-1].append(seq)
            used += len(seq)
        width = max(sum(len(s) for s in row) for row in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        pos = torch.zeros((len(rows), width), dtype=torch.long)
        last_row, last_col = [], []
        for r, row in enumerate(rows):
            col = 0
            for seq in row:
                ids[r, col:col + len(seq)] = torch.tensor(seq, dtype=torch.long)
                pos[r, col:col + len(seq)] = torch.arange(len(seq))
                col += len(seq)
                last_row.append(r)
                last_col.append(col - 1)
            pos[r, col:] = torch.arange(width - col)
        return Packed(ids, pos, torch.tensor(last_row), torch.tensor(last_col))


def shard_bounds(n: int, count: int) -> list[int]:
    """Boundaries of `count` contiguous shards of n items, sizes differing by at most one."""
    base, extra = divmod(n, count)
    bounds = [0]
    for i in range(count):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


class ClassificationTask:
    def __init__(self, cfg, tokenizer):
        self.name = cfg.name
        self.template = cfg.template
        self.max_length = cfg.max_length
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.label_words = list(cfg.label_words)
        self.label_ids = torch.tensor(self._label_token_ids(self.label_words), dtype=torch.long)
        self.splits: Splits = load_splits(cfg.dataset, cfg.val_size, cfg.test_size, cfg.train_size,
                                          cfg.split_seed, cfg.num_examples)
        self._encoded = {name: [self.encode(ex.text) for ex in getattr(self.splits, name)]
                         for name in ("train", "validation", "test")}
        self._labels = {name: torch.tensor([ex.label for ex in getattr(self.splits, name)], dtype=torch.long)
                        for name in ("train", "validation", "test")}
        n_classes = len(self.label_words)
        for name, labels in self._labels.items():
            if labels.numel() and int(labels.max()) >= n_classes:
                raise ConfigError(f"task {self.name}: {name} has label {int(labels.max())} but only "
                                 f"{n_classes} label words")

    def _label_token_ids(self, words: list[str]) -> list[int]:
        ids = []
        for w in words:
            toks = self.tokenizer(w, add_special_tokens=False).input_ids
            if not toks:
                raise ConfigError(f"task.label_words: {w!r} encodes to no token; use a non-empty word")
            if len(toks) > 1:
                log.warning("label word %r is %d tokens; scoring its first token only", w, len(toks))
            ids.append(toks[0])
        if len(set(ids)) != len(ids):
            raise ConfigError(f"task.label_words={words} share a first token; choose words whose first tokens differ")
        return ids

    def encode(self, sentence: str) -> list[int]:
        ids = self.tokenizer(self.template.format(sentence=sentence)).input_ids
        eos = self.tokenizer.eos_token_id
        # Some tokenizers append EOS; the prompt must end on its own last token.
        if eos is not None and len(ids) > 1 and ids[-1] == eos and eos != self.tokenizer.bos_token_id:
            ids = ids[:-1]
        return ids[-self.max_length:]  # keep the end: the template's cue is there

    def size(self, split: str) -> int:
        return len(self._encoded[split])

    def batch(self, split: str, indices) -> Batch:
        indices = list(indices)
        return Batch([self._encoded[split][i] for i in indices], self._labels[split][indices], self.pad_id)

    def batches(self, split: str, batch_size: int):
        n = self.size(split)
        for lo in range(0, n, batch_size):
            yield self.batch(split, range(lo, min(lo + batch_size, n)))


class TrainSampler:
    """Global batches as a pure function of (data seed, step): successive shuffled epochs, read in
    order. No state to save; resuming at step t or changing the mesh gives the same batches."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self._perm_epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (2**63))
            self._perm, self._perm_epoch = torch.randperm(self.n, generator=gen), epoch
        return self._perm

    def indices(self, step: int) -> list[int]:
        out = []
        for pos in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, offset = divmod(pos, self.n)
            out.append(int(self._permutation(epoch)[offset]))
        return out
