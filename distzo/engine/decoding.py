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
under engine.decode_cache=true).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from ..data.batches import NO_TARGET, Batch, Packed, Scores, label_word_batch
from ..models.kv_cache import DecodeKV, KVHooks, install, unsupported_reason
from ..peft.prefix import has_prefix
from ..zo.estimators import Probe
from .base import EngineConfigError

if TYPE_CHECKING:
    from .loop import StageLoop

log = logging.getLogger(__name__)


def tolerance(dtype: torch.dtype, compute: str) -> float:
    """The relative tolerance (of the largest |logit| + 1) between a walk with and without the cache.
    Both run the same products on the same weights; attention reduces over differently shaped keys
    and the matmuls see other row counts, so the logits differ by a few rounding steps of the
    forward's arithmetic compounded over the layers: far below 1e-3 in float32 (1e-6 measured on the
    test models), a few 1e-3 in 16-bit arithmetic. A cache that misplaces a position or a mask
    moves logits by O(1)."""
    return 1e-3 if dtype in (torch.float32, torch.float64) and compute != "bf16" else 5e-2


class Decoder:
    """Decodes batches for a `StageLoop` (see the module docstring). setting: engine.decode_cache."""

    def __init__(self, loop: StageLoop, setting: str = "auto"):
        self.loop, self.setting = loop, setting
        self.hooks: KVHooks | None = None
        self.off: str | None = None  # why the cache is not used (switched off, unsupported, failed check)
        self.checked = False
        if setting == "false":
            self.off = "engine.decode_cache=false"
        elif setting == "true":
            reason = self._unsupported()
            if reason is not None:
                raise EngineConfigError(f"engine.decode_cache=true: {reason}; use engine.decode_cache=auto")

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
        """For a walk: call(e, fn, *args) runs fn(*args) with probe e's attention layers on caches[e]
        (plainly without caches)."""
        if caches is None:
            return lambda e, fn, *args: fn(*args)

        def call(e: int, fn: Callable, *args):
            with self.hooks.using(caches[e]):
                return fn(*args)

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
        vocab = torch.arange(loop.adapter.config.vocab_size)
        prompts = [list(s.tokens) for s in batch.sequences]
        generated = [[[] for _ in prompts] for _ in mine]
        probes = [plan[i] for i in mine]

        def full_walk() -> list[Scores]:  # every sequence whole: the prompt and what it generated so far
            parts = [[loop.pack(label_word_batch([p + g for p, g in zip(prompts, out)], batch.labels, vocab,
                                                 batch.pad_id)).to(loop.device)] for out in generated]
            return loop._run(parts, probes, step, plan)

        def take(scores: Sequence[Scores]) -> None:
            for out, sc in zip(generated, scores):
                for tokens, token in zip(out, sc.logits.argmax(dim=-1).tolist()):
                    tokens.append(token)

        if hooks is None:
            for _ in range(batch.decode_tokens):
                take(full_walk())
        else:
            first = loop.pack(label_word_batch(prompts, batch.labels, vocab, batch.pad_id))
            layout = _Layout(first, [len(p) for p in prompts], loop.device)
            caches = [hooks.new() for _ in mine]
            for kv in caches:
                kv.extend(layout.seq, layout.pos, first=True)
            take(loop._run([[first.to(loop.device)]] * len(mine), probes, step, plan, caches))
            for t in range(1, batch.decode_tokens):
                if caches is None:
                    take(full_walk())
                    continue
                seq, pos = layout.next_columns(t, caches[0].columns)
                for kv in caches:
                    kv.extend(seq, pos, first=False)
                parts = [[layout.newest(out, vocab, batch.pad_id, t)] for out in generated]
                scores = loop._run(parts, probes, step, plan, caches)
                if checking and t == 1:
                    reference = full_walk()
                    if not self._agrees(scores, reference):
                        scores, caches = reference, None
                take(scores)
        zeros = torch.zeros(batch.units, dtype=torch.float64)
        return {i: Scores(zeros, zeros, None, out) for i, out in zip(mine, generated)}

    def _agrees(self, cached: Sequence[Scores], reference: Sequence[Scores]) -> bool:
        """The check of a run's first cached walk against the same walk without the cache."""
        rel = tolerance(self.loop.adapter.dtype, self.loop.compute)
        worst = bound = 0.0
        for c, r in zip(cached, reference):
            ref = r.logits.double()
            worst = max(worst, float((c.logits.double() - ref).abs().max()))
            bound = max(bound, rel * (float(ref.abs().max()) + 1.0))
        if worst <= bound:
            log.info("decoding with a KV cache (checked: largest logit difference %.2g against decoding without it)",
                     worst)
            return True
        message = (f"{self.loop.adapter.arch}: decoding with distzo's KV cache does not reproduce decoding without "
                   f"it (largest logit difference {worst:.3g}, tolerance {bound:.3g})")
        if self.setting == "true":
            raise EngineConfigError(f"engine.decode_cache=true: {message}; use engine.decode_cache=auto")
        log.warning("%s; decoding without the cache", message)
        self.off = message
        return False


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

    def newest(self, generated: Sequence[Sequence[int]], vocab: torch.Tensor, pad_id: int, t: int) -> Packed:
        """Walk t's rows for one evaluation: each sequence's newest token, scored over `vocab`."""
        ids = torch.full((len(self.members), self.width), pad_id, dtype=torch.long)
        for r, m in enumerate(self.members):
            ids[r, :len(m)] = torch.tensor([generated[i][-1] for i in m], dtype=torch.long)
        targets = torch.full((self.units,), NO_TARGET, dtype=torch.long)
        return Packed(ids, self.positions(t), self.real, self.score_row, self.score_col, targets, self.score_unit,
                      self.units, vocab).to(self.device)
