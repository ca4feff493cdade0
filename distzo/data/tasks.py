"""Prompted classification: prompts, label words, padded batches, and the layout-free batch sampler.

A prompt is `template.format(sentence=...)`; the model's next-token logits at the prompt's last
token, restricted to the label words' tokens, are the class scores (MeZO's SST-2 setup: loss =
cross-entropy over the label words' logits, prediction = the highest one).
"""

from __future__ import annotations

import logging
import torch

from ..errors import ConfigError
from ..scoring import Batch, label_word_batch
from .datasets import Splits, load_splits

log = logging.getLogger(__name__)


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
        return label_word_batch([self._encoded[split][i] for i in indices], self._labels[split][indices],
                                self.label_ids, self.pad_id)

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
