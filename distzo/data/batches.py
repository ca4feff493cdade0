"""The scoring contract between a task and an engine.

A task hands an engine a `Batch`: token sequences and, in them, the positions whose next-token
distribution is scored. Each scored position belongs to a *unit* (a label word, one candidate
continuation, a completion) and names either a target token, whose negative log-likelihood the
engine sums per unit, or nothing, when the task only wants the logits of a few candidate vocabulary
ids there (single-token label words: MeZO's classification head). The engine returns `Scores` per
evaluation: for every unit `(sum of target-token losses, count)` and, when asked, the candidate
logits. It evaluates the LM head only at scored positions, and over the whole vocabulary only where
a target's log-probability needs the normaliser.

Label words, multi-token candidates, multiple-choice options and SFT completions are all this one
contract with different targets. A sequence may also carry *branches*: continuations of its prefix
that each see the prefix but not one another (a multiple-choice example's candidates after its
shared prompt), so the prompt is computed once per example instead of once per candidate.

Sums and counts, never means: ranks holding different shards of a batch add their pairs, and the
ratio is the exact mean over the global batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any
from typing import Sequence as Seq

import torch

NO_TARGET = -1  # a scored position whose candidate logits are wanted, not a target's log-likelihood


@dataclass(frozen=True)
class TokenSequence:
    """One packed unit of input: a prefix, then each branch end to end.

    branches: start offsets (in `tokens`) of continuations that each follow the prefix: a branch's
      positions continue from the prefix's length and it attends to the prefix and to itself only.
    scored: offsets whose next-token distribution is scored; targets: the token each must predict
      (NO_TARGET: candidate logits only); units: the unit (numbered within the batch) each belongs to."""

    tokens: tuple[int, ...]
    branches: tuple[int, ...] = ()
    scored: tuple[int, ...] = ()
    targets: tuple[int, ...] = ()
    units: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.scored) == len(self.targets) == len(self.units):
            raise ValueError("scored, targets and units must have one entry per scored position")
        if any(not 0 <= b < len(self.tokens) for b in self.branches) or list(self.branches) != sorted(self.branches):
            raise ValueError(f"branch offsets {self.branches} must be increasing offsets into "
                             f"{len(self.tokens)} tokens")

    def positions(self) -> list[int]:
        """Position ids: the prefix from 0, every branch continuing from the prefix's length."""
        if not self.branches:
            return list(range(len(self.tokens)))
        prefix = self.branches[0]
        out = list(range(prefix))
        bounds = list(self.branches) + [len(self.tokens)]
        for lo, hi in zip(bounds, bounds[1:]):
            out += range(prefix, prefix + hi - lo)
        return out

    def unbranched(self) -> list[TokenSequence]:
        """The same scores as plain sequences: the prefix followed by each branch in turn. A scored
        position inside the prefix sees the same tokens in every copy, so it goes to the first."""
        if not self.branches:
            return [self]
        prefix = self.branches[0]
        bounds = list(self.branches) + [len(self.tokens)]
        out = []
        for b, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            picked = [(o if o < prefix else o - lo + prefix, t, u)
                      for o, t, u in zip(self.scored, self.targets, self.units)
                      if (o < prefix and b == 0) or lo <= o < hi]
            out.append(TokenSequence(self.tokens[:prefix] + self.tokens[lo:hi], (), tuple(o for o, _, _ in picked),
                                tuple(t for _, t, _ in picked), tuple(u for _, _, u in picked)))
        return out

    def branch_ids(self) -> list[int]:
        """0 for the prefix, b + 1 for the tokens of branch b."""
        out = [0] * len(self.tokens)
        bounds = list(self.branches) + [len(self.tokens)]
        for b, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            out[lo:hi] = [b + 1] * (hi - lo)
        return out


@dataclass
class Batch:
    """A batch of examples as the engine runs them. Examples are independent: `shard` takes any
    contiguous range of them, with their sequences and units.

    sequence_example / unit_example: the example each sequence and each unit belongs to (both
      non-decreasing). candidates: vocabulary ids whose logits each unit's single scored position
      returns (None: none). labels: per example, what the task's objective compares against (for
      classification and multiple choice the gold unit's index within the example); `readout` says
      how an objective reads the scores (`distzo.data.objectives`); `extra` holds further per-example
      fields a task needs (lists or tensors of one entry per example)."""

    sequences: list[TokenSequence]
    sequence_example: list[int]
    unit_example: list[int]
    labels: torch.Tensor
    candidates: torch.Tensor | None = None
    pad_id: int = 0
    readout: str = "logits"
    extra: dict[str, Any] = field(default_factory=dict)
    decode_tokens: int = 0  # readout "decode": tokens to generate greedily after each sequence

    @property
    def size(self) -> int:
        """Examples."""
        return int(self.labels.shape[0])

    @property
    def units(self) -> int:
        return len(self.unit_example)

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.sequences)

    def units_per_example(self) -> list[int]:
        counts = [0] * self.size
        for e in self.unit_example:
            counts[e] += 1
        return counts

    def micro_batches(self, size: int | None) -> list[Batch]:
        """Consecutive pieces of at most `size` examples (the whole batch when size is None or larger)."""
        if not size or size >= self.size:
            return [self]
        return [self.examples(lo, min(lo + size, self.size)) for lo in range(0, self.size, size)]

    def shard(self, index: int, count: int) -> Batch:
        """The index-th of `count` contiguous shards of the examples (sizes differ by at most one)."""
        bounds = shard_bounds(self.size, count)
        return self.examples(bounds[index], bounds[index + 1])

    def examples(self, lo: int, hi: int) -> Batch:
        """Examples [lo, hi) with their sequences and units, renumbered from 0."""
        first_unit = next((u for u, e in enumerate(self.unit_example) if e >= lo), self.units)
        seqs = [(s, e) for s, e in zip(self.sequences, self.sequence_example) if lo <= e < hi]
        units = [e - lo for e in self.unit_example if lo <= e < hi]
        return Batch([replace(s, units=tuple(u - first_unit for u in s.units)) for s, _ in seqs],
                     [e - lo for _, e in seqs], units, self.labels[lo:hi], self.candidates, self.pad_id,
                     self.readout, {k: v[lo:hi] for k, v in self.extra.items()}, self.decode_tokens)

    def pack(self, row_tokens: int = 1024, window: int | None = None) -> Packed:
        """The sequences packed into rows (`Packed`). window: the model's smallest sliding attention
        window, if any; a sequence with branches longer than it is packed as its unbranched copies
        (`TokenSequence.unbranched`), since the mask helpers measure a window in row offsets."""
        sequences = self.sequences
        if window is not None and any(s.branches and len(s.tokens) > window for s in sequences):
            sequences = [u for s in sequences for u in (s.unbranched() if len(s.tokens) > window else [s])]
        return pack(sequences, self.units, self.candidates, self.pad_id, row_tokens)

    def unbranched(self) -> Batch:
        """The same batch with every candidate in a full sequence of its own (prompt repeated): what
        scoring costs without shared prompts (`bench`)."""
        seqs, owners = [], []
        for s, e in zip(self.sequences, self.sequence_example):
            parts = s.unbranched()
            seqs += parts
            owners += [e] * len(parts)
        return replace(self, sequences=seqs, sequence_example=owners)


def label_word_batch(prompts: Seq[Seq[int]], labels: torch.Tensor, label_ids: torch.Tensor,
                     pad_id: int = 0) -> Batch:
    """Single-token label words: one unit per prompt, the label words' logits at its last token."""
    seqs = [TokenSequence(tuple(p), scored=(len(p) - 1,), targets=(NO_TARGET,), units=(i,))
            for i, p in enumerate(prompts)]
    n = len(seqs)
    return Batch(seqs, list(range(n)), list(range(n)), labels, label_ids, pad_id, "logits")


def shard_bounds(n: int, count: int) -> list[int]:
    """Boundaries of `count` contiguous shards of n items, sizes differing by at most one."""
    base, extra = divmod(n, count)
    bounds = [0]
    for i in range(count):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


@dataclass
class Packed:
    """Sequences packed end to end into rows of at most `row_tokens` tokens (a longer sequence gets a
    row of its own). Position ids restart at 0 for every sequence, which transformers' mask helpers
    turn into a block-causal mask, so no sequence sees another and almost no compute is spent on
    padding; row tails are filled with a pad segment of its own positions, masked off the same way.

    With branches, position ids alone cannot say who sees whom, so `segment` (the sequence of each
    token, numbered per row; -1 in the tail) and `branch` (0 prefix, b + 1 branch b) carry it, and
    `mask_fn` turns them into a transformers-style mask function the adapters intersect with the
    model's causal masks."""

    input_ids: torch.Tensor  # [R, T]
    position_ids: torch.Tensor  # [R, T]
    real: torch.Tensor  # [R, T] bool: a sequence's token (False in row tails)
    score_row: torch.Tensor  # [N] row of each scored position
    score_col: torch.Tensor  # [N] column of each scored position
    score_target: torch.Tensor  # [N] target token, or NO_TARGET
    score_unit: torch.Tensor  # [N] unit of each scored position
    units: int
    candidates: torch.Tensor | None = None
    segment: torch.Tensor | None = None  # [R, T], only when some sequence has branches
    branch: torch.Tensor | None = None  # [R, T], idem
    whole_vocabulary: bool = False  # candidates are every vocabulary id in order (the head reads its whole table)

    def to(self, device: torch.device) -> Packed:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Packed(move(self.input_ids), move(self.position_ids), move(self.real), move(self.score_row),
                      move(self.score_col), move(self.score_target), move(self.score_unit), self.units,
                      move(self.candidates), move(self.segment), move(self.branch), self.whole_vocabulary)

    def replicate(self, times: int) -> Packed:
        """The rows repeated `times` over (rows [e R, (e + 1) R) are copy e), for batched evaluations;
        scored positions refer to the first copy."""
        rep = lambda t: None if t is None else t.repeat(times, 1)  # noqa: E731
        return Packed(rep(self.input_ids), rep(self.position_ids), rep(self.real), self.score_row, self.score_col,
                      self.score_target, self.score_unit, self.units, self.candidates, rep(self.segment),
                      rep(self.branch), self.whole_vocabulary)

    def mask_fn(self):
        """None for plain packed rows; for rows with branches, a mask function (batch, head, q, kv) ->
        bool: same sequence, and kv in the prefix or in q's own branch (causality comes from the
        model's own mask)."""
        if self.segment is None:
            return None
        segment, branch = self.segment, self.branch

        def visible(batch_idx, head_idx, q_idx, kv_idx):
            same = segment[batch_idx, q_idx] == segment[batch_idx, kv_idx]
            kv_branch = branch[batch_idx, kv_idx]
            return same & ((kv_branch == 0) | (kv_branch == branch[batch_idx, q_idx]))

        return visible


def pack(sequences: Seq[TokenSequence], units: int, candidates: torch.Tensor | None, pad_id: int,
         row_tokens: int) -> Packed:
    rows: list[list[int]] = [[]]
    used = 0
    for i, seq in enumerate(sequences):
        if rows[-1] and used + len(seq.tokens) > row_tokens:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += len(seq.tokens)
    width = max(sum(len(sequences[i].tokens) for i in row) for row in rows)
    branched = any(s.branches for s in sequences)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    real = torch.zeros((len(rows), width), dtype=torch.bool)
    segment = torch.full((len(rows), width), -1, dtype=torch.long) if branched else None
    branch = torch.zeros((len(rows), width), dtype=torch.long) if branched else None
    where = [(0, 0)] * len(sequences)
    for r, row in enumerate(rows):
        col = 0
        for j, i in enumerate(row):
            seq = sequences[i]
            n = len(seq.tokens)
            ids[r, col:col + n] = torch.tensor(seq.tokens, dtype=torch.long)
            pos[r, col:col + n] = torch.tensor(seq.positions(), dtype=torch.long)
            real[r, col:col + n] = True
            if branched:
                segment[r, col:col + n] = j
                branch[r, col:col + n] = torch.tensor(seq.branch_ids(), dtype=torch.long)
            where[i] = (r, col)
            col += n
        pos[r, col:] = torch.arange(width - col)
    score_row, score_col, score_target, score_unit = [], [], [], []
    for i, seq in enumerate(sequences):
        r, start = where[i]
        score_row += [r] * len(seq.scored)
        score_col += [start + o for o in seq.scored]
        score_target += list(seq.targets)
        score_unit += list(seq.units)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return Packed(ids, pos, real, as_long(score_row), as_long(score_col), as_long(score_target),
                  as_long(score_unit), units, candidates, segment, branch)


@dataclass
class Scores:
    """What an engine returns for one evaluation of a batch, per unit: `nll` the sum over the unit's
    scored positions of -log p(target) and `count` how many targets it has (float64, zero for units
    without targets), and `logits` [units, candidates] where the batch asked for candidate logits.
    A batch with readout "decode" gets `generated` instead: the tokens each sequence continues with,
    greedily, under the evaluation's weights (a decoding objective's input)."""

    nll: torch.Tensor
    count: torch.Tensor
    logits: torch.Tensor | None = None
    generated: list[list[int]] | None = None  # readout "decode": each sequence's greedy continuation

    def to(self, device: torch.device | str) -> Scores:
        return Scores(self.nll.to(device), self.count.to(device),
                      None if self.logits is None else self.logits.to(device), self.generated)
