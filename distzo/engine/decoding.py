"""A decoding objective's answers (objective=f1, exact_match): greedy continuations of a batch's
sequences under each of this rank's probes, generated through the step loop.

Every token is one walk of the stage loop under the step's perturbations, so decoding runs in every
mode and on every mesh; every rank makes the same number of walks (no early stop), since a walk
may be collective (divided and sliced stores). With the decode cache (`engine.decode_cache`,
distzo/models/kv_cache.py) the first walk runs the packed prompts and keeps each attention layer's
keys and values per evaluation, and each later walk runs only the newest token of every sequence;
without it each walk runs the prompts and everything generated so far again. The first decode of a
run checks the cache: its second walk is also run without the cache, and the two walks' logits must
agree within rounding (`tolerance`), else the run decodes without the cache from there on (an error
under engine.decode_cache=true). A forward that fails with the cache's stand-in (an attention asking
for more than `update`) on the run's first decode does the same under auto where the failed walk
leaves nothing behind (resident weights on one stream, no peers in the walk: `_recoverable`);
otherwise it is an error naming engine.decode_cache=false. Each rank checks its
own evaluations. The tokens are those of decoding without the cache up to rounding: a near tie
between two tokens' logits may break the other way, as between two mesh layouts.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from ..data.batches import NO_TARGET, Batch, Packed, Scores, label_word_batch
from ..models.kv_cache import DecodeKV, KVHooks, install, unsupported_reason
from ..peft.prefix import has_prefix
from ..zo.estimators import Probe
from .base import EngineConfigError
from .stores import ResidentStore

if TYPE_CHECKING:
    from .loop import StageLoop

log = logging.getLogger(__name__)


def tolerance(dtype: torch.dtype, compute: str) -> float:
    """The relative tolerance (of the largest |logit| + 1) between a walk with and without the cache.
    Both run the same products on the same weights; attention reduces over differently shaped keys
    and the matmuls see other row counts, so the logits differ by a few rounding steps of the
    forward's arithmetic compounded over the layers: far below 1e-3 in float32 (3.7e-5 on the
    embedded default's logits of O(10)), a few 1e-3 in 16-bit or TF32 arithmetic. A cache that
    misplaces a position or a mask moves logits by O(1)."""
    full = dtype in (torch.float32, torch.float64) and compute not in ("bf16", "tf32")
    return 1e-3 if full else 5e-2


class CacheFailed(Exception):
    """A forward through a stage failed with the cache's stand-in (an attention asking for more of
    a cache than `LayerKV.update`)."""


class Decoder:
    """Decodes batches for a `StageLoop` (see the module docstring). setting: engine.decode_cache.
    verify_every_walk: check every cached walk against one without the cache, not only the run's
    first (tests; it costs a full walk per token); `worst` is the largest logit difference seen."""

    verify_every_walk = False

    def __init__(self, loop: StageLoop, setting: str = "auto"):
        self.loop, self.setting = loop, setting
        self.hooks: KVHooks | None = None
        self.off: str | None = None  # why the cache is not used (switched off, unsupported, failed check)
        self.checked = False
        self.worst = 0.0
        if setting == "false":
            self.off = "engine.decode_cache=false"
        elif setting == "true":
            reason = self._unsupported()
            if reason is not None:
                raise EngineConfigError(f"engine.decode_cache=true: {reason}; use engine.decode_cache=auto")
            self.hooks = install(loop.model)  # checked: the first decode needs not ask again

    def close(self) -> None:
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None

    def _unsupported(self) -> str | None:
        """Why the cache cannot run on this engine's model (None: it can)."""
        if has_prefix(self.loop.model):
            return "peft=prefix hands each attention its prefix through the same cache argument"
        return unsupported_reason(self.loop.model, len(self.loop.adapter.blocks))

    def attending(self, caches: Sequence[DecodeKV] | None) -> Callable:
        """For a walk: call(e, fn, *args) runs fn(*args) (a forward through a stage) with probe e's
        attention layers on caches[e] (plainly without caches); a failure there is `CacheFailed`."""
        if caches is None:
            return lambda e, fn, *args: fn(*args)

        def call(e: int, fn: Callable, *args):
            with self.hooks.using(caches[e]):
                try:
                    return fn(*args)
                except torch.OutOfMemoryError:
                    raise
                except Exception as exc:  # noqa: BLE001 - an attention needing more of a cache than the stand-in
                    raise CacheFailed(f"{type(exc).__name__}: {exc}") from exc

        return call

    def _cache(self, tokens: int) -> KVHooks | None:
        """The hooks when this decode uses the cache (a single token needs none)."""
        if self.off is not None or tokens < 2:
            return None
        if self.hooks is None:
            reason = self._unsupported()
            if reason is not None:
                self.off = reason
                log.info("decoding without a KV cache: %s", reason)
                return None
            self.hooks = install(self.loop.model)
        return self.hooks

    def _recoverable(self) -> bool:
        """Whether a walk that failed halfway leaves nothing behind that another walk trips over:
        resident weights on one stream, no peers sharing the walk (divided, sliced and offloaded
        stores hold slots or wait on peers mid-walk). The stages the failed walk reached have their
        pending update applied and no longer await it; the next walk applies it to the others."""
        loop = self.loop
        return (type(loop.store) is ResidentStore and not loop.store.walks_with_peers
                and not loop.division.with_peers and loop.copy_streams is None)

    def run(self, batch: Batch, plan: Sequence[Probe], step: int) -> dict[int, Scores]:
        """Greedy continuations of the batch's sequences under each of this rank's probes,
        `batch.decode_tokens` tokens long, each the argmax of the full vocabulary's logits."""
        loop = self.loop
        mine = loop.mesh.my_probes(len(plan))
        hooks = self._cache(batch.decode_tokens)
        checking = hooks is not None and not self.checked
        self.checked = self.checked or checking
        if not mine:
            for _ in range(batch.decode_tokens + int(checking)):
                if loop.store.walks_with_peers:
                    loop._walk_with_peers()
            return {}
        answers = _Answers(loop, batch, [plan[i] for i in mine], plan, step)
        if hooks is not None:
            try:
                self._decode_cached(answers, hooks, checking)
            except CacheFailed as exc:
                message = f"{loop.adapter.arch}: decoding with distzo's KV cache failed ({exc})"
                if not (checking and self.setting == "auto" and self._recoverable()):
                    raise EngineConfigError(f"{message}; use engine.decode_cache=false") from exc.__cause__
                log.warning("%s; decoding without the cache", message)
                self._switch_off(message)
                answers.reset()
                hooks = None
        if hooks is None:
            for _ in range(batch.decode_tokens):
                answers.take(answers.full_walk())
        zeros = torch.zeros(batch.units, dtype=torch.float64)
        return {i: Scores(zeros, zeros, None, out) for i, out in zip(mine, answers.generated)}

    def _decode_cached(self, answers: _Answers, hooks: KVHooks, checking: bool) -> None:
        """The first walk over the packed prompts, filling each evaluation's cache; each later walk
        over the newest tokens. The run's first decode checks its second walk (and, with
        verify_every_walk, every later one) against a walk without the cache; after a mismatch the
        rest of the decode runs without it."""
        loop, batch = self.loop, answers.batch
        first = answers.packed(answers.prompts)
        layout = _Layout(first, [len(p) for p in answers.prompts], loop.device)
        caches: list[DecodeKV] | None = [hooks.new() for _ in answers.probes]
        for kv in caches:
            kv.extend(layout.seq, layout.pos, first=True)
        answers.take(answers.walk([[first.to(loop.device)]] * len(caches), caches))
        for t in range(1, batch.decode_tokens):
            if caches is None:
                answers.take(answers.full_walk())
                continue
            seq, pos = layout.next_columns(t, caches[0].columns)
            for kv in caches:
                kv.extend(seq, pos, first=False)
            parts = [[layout.newest(out, answers.vocab, batch.pad_id, pos)] for out in answers.generated]
            scores = answers.walk(parts, caches)
            if (checking and t == 1) or self.verify_every_walk:
                reference = answers.full_walk()
                if not self._agrees(scores, reference, first_check=checking and t == 1):
                    scores, caches = reference, None
            answers.take(scores)

    def _agrees(self, cached: Sequence[Scores], reference: Sequence[Scores], first_check: bool) -> bool:
        """A cached walk's logits against the same walk's without the cache."""
        rel = tolerance(self.loop.adapter.dtype, self.loop.compute)
        worst = bound = 0.0
        for c, r in zip(cached, reference):
            ref = r.logits.double()
            worst = max(worst, float((c.logits.double() - ref).abs().max()))
            bound = max(bound, rel * (float(ref.abs().max()) + 1.0))
        self.worst = max(self.worst, worst)
        if worst <= bound:
            if first_check:
                log.info("decoding with a KV cache (checked: largest logit difference %.2g against decoding without "
                         "it)", worst)
            return True
        message = (f"{self.loop.adapter.arch}: decoding with distzo's KV cache does not reproduce decoding without "
                   f"it (largest logit difference {worst:.3g}, tolerance {bound:.3g})")
        if self.setting == "true":
            raise EngineConfigError(f"engine.decode_cache=true: {message}; use engine.decode_cache=auto")
        log.warning("%s; decoding without the cache", message)
        self._switch_off(message)
        return False

    def _switch_off(self, reason: str) -> None:
        """Decode without the cache from now on (the hooks removed)."""
        self.off = reason
        self.close()


class _Answers:
    """One batch's answers on this rank, as they grow: probes[k]'s continuation of sequence i is
    generated[k][i]."""

    def __init__(self, loop: StageLoop, batch: Batch, probes: Sequence[Probe], plan: Sequence[Probe], step: int):
        self.loop, self.batch, self.probes, self.plan, self.step = loop, batch, list(probes), plan, step
        self.prompts = [list(s.tokens) for s in batch.sequences]
        self.vocab = torch.arange(loop.adapter.config.vocab_size)
        self.reset()

    def reset(self) -> None:
        self.generated: list[list[list[int]]] = [[[] for _ in self.prompts] for _ in self.probes]

    def packed(self, sequences: Sequence[Sequence[int]]) -> Packed:
        """Sequences packed as the engine packs them, scored at their last token over the whole vocabulary."""
        b = self.batch
        return replace(self.loop.pack(label_word_batch(sequences, b.labels, self.vocab, b.pad_id)),
                       whole_vocabulary=True)

    def walk(self, parts, caches: Sequence[DecodeKV] | None = None) -> list[Scores]:
        return self.loop._run(parts, self.probes, self.step, self.plan, caches)

    def full_walk(self) -> list[Scores]:
        """Every sequence whole: its prompt and what it generated so far."""
        return self.walk([[self.packed([p + g for p, g in zip(self.prompts, out)]).to(self.loop.device)]
                          for out in self.generated])

    def take(self, scores: Sequence[Scores]) -> None:
        for out, sc in zip(self.generated, scores):
            for tokens, token in zip(out, sc.logits.argmax(dim=-1).tolist()):
                tokens.append(token)


class _Layout:
    """Where each sequence of the first walk's packed rows is, and the later walks' rows: row r holds
    the newest token of each sequence packed in row r, in the same order."""

    def __init__(self, first: Packed, lengths: Sequence[int], device: torch.device):
        rows, width = first.input_ids.shape
        seq = torch.full((rows, width), -1, dtype=torch.long)
        self.members: list[list[int]] = [[] for _ in range(rows)]
        for i, (r, end) in enumerate(zip(first.score_row.tolist(), first.score_col.tolist())):
            seq[r, end - lengths[i] + 1:end + 1] = i  # a sequence's last token is its scored position
            self.members[r].append(i)
        self.lengths, self.units, self.device = list(lengths), len(lengths), device
        self.seq, self.pos = seq.to(device), first.position_ids.to(device)
        self.width = max(len(m) for m in self.members)
        where = [(r, j) for r, m in enumerate(self.members) for j in range(len(m))]
        order = [i for m in self.members for i in m]
        self.score_row = torch.tensor([r for r, _ in where], dtype=torch.long)
        self.score_col = torch.tensor([j for _, j in where], dtype=torch.long)
        self.score_unit = torch.tensor(order, dtype=torch.long)
        self.real = torch.zeros((rows, self.width), dtype=torch.bool)
        self.real[self.score_row, self.score_col] = True

    def positions(self, t: int) -> torch.Tensor:
        """Positions of walk t's columns: the token generated by walk t - 1 sits at length + t - 1."""
        pos = torch.zeros((len(self.members), self.width), dtype=torch.long)
        for r, m in enumerate(self.members):
            for j, i in enumerate(m):
                pos[r, j] = self.lengths[i] + t - 1
        return pos

    def next_columns(self, t: int, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ids and positions of walk t's columns. A padding column gets an id of its own
        (below -1, from its column number among everything kept), so it attends to itself only."""
        rows = len(self.members)
        seq = -2 - (kept + torch.arange(rows * self.width).view(rows, self.width))
        for r, m in enumerate(self.members):
            seq[r, :len(m)] = torch.tensor(m, dtype=torch.long)
        return seq.to(self.device), self.positions(t).to(self.device)

    def newest(self, generated: Sequence[Sequence[int]], vocab: torch.Tensor, pad_id: int,
               pos: torch.Tensor) -> Packed:
        """A later walk's rows for one evaluation: each sequence's newest token at its position `pos`
        (`next_columns`), scored over `vocab`."""
        ids = torch.full((len(self.members), self.width), pad_id, dtype=torch.long)
        for r, m in enumerate(self.members):
            ids[r, :len(m)] = torch.tensor([generated[i][-1] for i in m], dtype=torch.long)
        targets = torch.full((self.units,), NO_TARGET, dtype=torch.long)
        return Packed(ids, pos, self.real, self.score_row, self.score_col, targets, self.score_unit,
                      self.units, vocab, whole_vocabulary=True).to(self.device)
