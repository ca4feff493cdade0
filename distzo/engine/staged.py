"""The stage loop every split engine shares: stem -> blocks -> final + head, all probes per stage.

For each stage the engine draws the stage's z once per query and runs every probe of the step
through that stage before moving on, so the + and - passes share one noise generation (ZO2's
"dual forward", generalised to any plan).

Updates are deferred (docs/architecture.md#invariants, I5): `apply` records the step's update, and
the next step applies it to each stage as the stage comes up, fused chunk by chunk with that stage's
perturbation (one pass over the weights instead of two). `materialized` applies whatever is still
owed before anything reads the weights. Every owed update is paid by one method, `_pay` (the
work-divided mode overrides it); docs/architecture.md#engines tables where and when each mode calls it.

`StagedEngine` is the loop; `ResidentEngine` runs it with every weight on the compute device. The
other modes are subclasses that override a few hooks: where a block's weights are while it computes
(`block_sources`) and what a payment reaches there (`_targets`), how a block's working copies are
built (`_prepare_block`), how a flush reaches a block (`_flush_block`), and whether a rank without
probes must still walk the blocks with its peers.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator, Mapping, Sequence

import torch
from torch import nn

from ..data.batches import NO_TARGET, Batch, Packed, Scores, label_word_batch
from ..models.adapters import DecoderAdapter
from ..parallel.mesh import Mesh
from ..telemetry.timing import DISABLED, Timers
from ..zo.directions import Directions
from ..zo.estimators import CLEAN, Probe
from ..zo.optimizers import SGD, Optimizer
from ..zo.params import TrainableParams
from .base import Engine, Materialized
from .chunkpass import PendingUpdate
from .optstate import StateBuffers
from .update import Target, apply_update
from .weights import CleanWeights, PerturbedWeights, StageNoise, Workspace

OUTER = "outer"  # the stage of every trainable parameter outside the blocks (embeddings, norms, head)
HEAD_ROWS = 256  # scored positions per full-vocabulary head product (bounds its [rows, vocab] temporary)


class StagedEngine(Engine):
    """Evaluates a step's plan stage by stage (see the module docstring); by default the weights are
    the parameters themselves, on the compute device.

    eps: the perturbation scale; mesh: which probes of a plan this rank runs (a 1x1 mesh when
    None); fuse_update: apply an owed update inside the next perturbation pass (False: in a pass of
    its own, for comparison); micro_batch_size: examples of a rank's shard per forward (None: the
    whole shard at once; see `_run`); timers: phase timers (`bench`); optimizer: the update rule and
    its state (`distzo.zo.optimizers`; sgd when None), held where the mode holds the master
    (`_build_state`)."""

    # Streaming a block involves collectives over the node (sliced offloading): a rank dealt no
    # probe must still walk every block with its peers.
    walks_with_peers = False

    def __init__(self, model: nn.Module, adapter: DecoderAdapter, params: TrainableParams, directions: Directions,
                 *, eps: float = 1e-3, mesh: Mesh | None = None, row_tokens: int = 1024, fuse_update: bool = True,
                 micro_batch_size: int | None = None, compute: str = "fp32", timers: Timers = DISABLED,
                 optimizer: Optimizer | None = None):
        for p in params:
            if not p.tensor.is_contiguous():
                raise ValueError(f"parameter {p.name} is not contiguous; the chunked update needs flat views")
        self.model, self.adapter, self.params, self.directions = model, adapter, params, directions
        self.device = directions.device
        self.eps, self.row_tokens, self.fuse_update, self.timers = float(eps), row_tokens, fuse_update, timers
        self.micro_batch_size = micro_batch_size
        self.compute = compute
        self.mesh = mesh if mesh is not None else Mesh.single(self.device)
        self.workspace = Workspace(self.device)
        self.block_params = [[p for p in params if p.name.startswith(prefix + ".")] for prefix, _ in adapter.blocks]
        in_blocks = {p.name for ps in self.block_params for p in ps}
        self.outer_params = [p for p in params if p.name not in in_blocks]
        self.pending: PendingUpdate | None = None
        self.optimizer = optimizer if optimizer is not None else SGD()
        self.state = self._build_state()

    def describe(self) -> str:
        return "resident"

    # --- the interface ------------------------------------------------------------------------------

    def run_probes(self, batch: Batch, plan: Sequence[Probe], step: int) -> dict[int, Scores]:
        if batch.readout == "decode":
            return self._decode(batch, plan, step)
        mine = self.mesh.my_probes(len(plan))
        if not mine:
            if self.walks_with_peers:
                self._walk_with_peers()
            return {}
        parts = [self.pack(b).to(self.device) for b in batch.micro_batches(self.micro_batch_size)]
        scores = self._run([parts] * len(mine), [plan[i] for i in mine], step, plan)
        return dict(zip(mine, scores))

    def apply(self, step: int, coefficients: Sequence[tuple[int, float]], lr: float, weight_decay: float) -> None:
        """Records the update as owed by every stage; `_pay` pays it (docs/architecture.md#engines)."""
        self.flush()  # a rank without probes never streamed the previous update
        stages = {OUTER, *range(len(self.block_params))}
        self.pending = PendingUpdate(step, tuple(coefficients), lr, weight_decay, stages,
                                     self.optimizer.rule(step, lr, weight_decay))

    @contextmanager
    def materialized(self) -> Iterator[Materialized]:
        self.flush()
        with self._local_reads():
            yield Materialized(self)

    def pack(self, batch: Batch) -> Packed:
        return batch.pack(self.row_tokens, self.adapter.attention_window)

    def score_clean(self, batch: Batch) -> Scores:
        if self.pending is not None:
            raise RuntimeError("internal error: a clean score outside `materialized()` (an update is still owed)")
        packed = self.pack(batch).to(self.device)
        return self._run([[packed]], [Probe(CLEAN, 0)], 0, None)[0]

    def _decode(self, batch: Batch, plan: Sequence[Probe], step: int) -> dict[int, Scores]:
        """Greedy continuations of the batch's sequences under each of this rank's probes,
        `batch.decode_tokens` tokens long: one walk per token, each probe on its own sequences
        (prompt plus what it generated so far), the next token the argmax of the full vocabulary's
        logits at the last position. No KV cache, so it runs in every mode, on every mesh, with the
        step's perturbations; every rank makes the same number of walks (no early stop)."""
        mine = self.mesh.my_probes(len(plan))
        if not mine:
            for _ in range(batch.decode_tokens):
                if self.walks_with_peers:
                    self._walk_with_peers()
            return {}
        vocab = torch.arange(self.adapter.config.vocab_size)
        prompts = [list(s.tokens) for s in batch.sequences]
        generated = {i: [[] for _ in prompts] for i in mine}
        for _ in range(batch.decode_tokens):
            parts = [[self.pack(label_word_batch([p + g for p, g in zip(prompts, generated[i])], batch.labels, vocab,
                                                 batch.pad_id)).to(self.device)] for i in mine]
            for i, scores in zip(mine, self._run(parts, [plan[i] for i in mine], step, plan)):
                for out, token in zip(generated[i], scores.logits.argmax(dim=-1).tolist()):
                    out.append(token)
        zeros = torch.zeros(batch.units, dtype=torch.float64)
        return {i: Scores(zeros, zeros, None, generated[i]) for i in mine}

    # --- deferred updates ---------------------------------------------------------------------------

    def take_pending(self, stage) -> PendingUpdate | None:
        """The update a stage owes, marking it paid."""
        u = self.pending
        if u is None or stage not in u.stages:
            return None
        u.stages.discard(stage)
        if not u.stages:
            self.pending = None
        return u

    def owes(self, stage) -> bool:
        return self.pending is not None and stage in self.pending.stages

    def _pay(self, stage, targets: Sequence[Target], noise: StageNoise | None = None) -> None:
        """Pay the update `stage` owes, if any, on `targets` (the stage's masters where they are now).
        Every owed update of the staged modes is paid here (`DividedEngine._pay` overrides it with
        its division of the chunks); docs/architecture.md#engines tables where and when each mode
        calls it. With `noise`, the stage's working copies are built too and the update is fused into
        that pass; it runs in a pass of its own without `noise`, with `fuse_update` off, or where the
        targets record their change as deltas (which the fused pass does not write)."""
        u = self.take_pending(stage)
        if u is not None and (noise is None or not self.fuse_update or any(t.delta is not None for t in targets)):
            with self.timers("update"):
                apply_update(self.directions, targets, u)
            u = None
        if noise is not None:  # an owed update still in hand is fused into this stage's perturbation
            masters = {t.param.name: t.tensor for t in targets}
            states = {t.param.name: t.state for t in targets}
            noise.prepare([t.param for t in targets], lambda p: masters[p.name], u, lambda p: states[p.name])

    @torch.inference_mode()
    def flush(self) -> None:
        """Pay the deferred update of every stage that still owes it (I5)."""
        if self.pending is None:
            self._settle()  # nothing owed, but copies of the last walk may still be in flight
            return
        self._before_write()
        with self.timers("update"):
            self._pay(OUTER, self._outer_targets())
            for i in range(len(self.block_params)):
                if self.owes(i):
                    self._flush_block(i)
            self._after_flush()

    def _pay_outer_if_owed(self) -> None:
        """The outer stage's owed update, at the start of a walk."""
        if self.owes(OUTER):
            with self.timers("update"):
                self._pay(OUTER, self._outer_targets())

    def _outer_targets(self) -> list[Target]:
        return [Target(p, p.tensor, state=self.state.of(p)) for p in self.outer_params]

    # --- the optimizer's state ----------------------------------------------------------------------

    def _build_state(self) -> StateBuffers:
        """The optimizer's state of the parameters this mode holds on the compute device (all of
        them here), zeros at the start."""
        return StateBuffers(self.optimizer.slots, list(self.params), self.device)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """The optimizer's state by `<slot>/<parameter>` (read inside `materialized`: current)."""
        return self.state.export()

    def load_optimizer_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore a snapshot's optimizer state (every rank calls it, before the first step)."""
        self.state.load(tensors)

    def optimizer_state_bytes(self) -> dict[str, int]:
        """`copy`: one copy of the optimizer's state; `resident`: what this rank holds of it (its
        share of a node-shared one)."""
        copy = self.optimizer.state_bytes(self.params.numel())
        return {"copy": copy, "resident": self.state.nbytes()}

    # --- hooks of the modes -------------------------------------------------------------------------

    @contextmanager
    def block_sources(self, i: int) -> Iterator[Mapping[str, torch.Tensor] | None]:
        """The tensors holding block i's parameters on the compute device while it computes (None:
        the parameters themselves)."""
        yield None

    def _targets(self, i: int, sources) -> list[Target]:
        """Where a payment reaches block i: its masters on the compute device (`sources` from
        `block_sources`)."""
        sources = sources or {}
        return [Target(p, sources.get(p.name, p.tensor), state=self.state.of(p)) for p in self.block_params[i]]

    def _flush_block(self, i: int) -> None:
        """A flush reaches block i, which owes the update."""
        with self.block_sources(i) as sources:
            self._pay(i, self._targets(i, sources))

    def _before_write(self) -> None:
        """Called before the master changes outside a block walk (flush, the outer stage)."""

    def _after_flush(self) -> None:
        """Wait for anything asynchronous a flush started."""

    def _settle(self) -> None:
        """Wait for asynchronous copies to the host masters (no collectives): before their reads."""

    def _after_walk(self, perturbed: bool) -> None:
        """Called after a walk's last stage."""

    @contextmanager
    def _local_reads(self) -> Iterator[None]:
        """The forwards inside read the (flushed) master without collectives."""
        yield

    def _walk_with_peers(self) -> None:
        """A rank dealt no probe walks the blocks anyway (paying owed updates) where its peers
        need it to (`walks_with_peers`). It pays the outer stage's owed update too, as `_walk` does, so
        that afterwards every rank owes the same stages: `flush` enters its collectives only when
        something is owed, and ranks that disagreed on that would wait on different collectives."""
        self._before_write()
        self._pay_outer_if_owed()
        for i in range(len(self.adapter.blocks)):
            with self.block_sources(i):
                pass

    def _prepare_block(self, i: int, sources, step: int, plan: Sequence[Probe], perturbed: bool,
                       full_plan: Sequence[Probe] | None) -> StageNoise:
        """Block i's working copies (none for a clean walk), its owed update paid on the way."""
        noise = self._noise(step, plan)
        self._pay(i, self._targets(i, sources), noise if perturbed else None)
        return noise

    def _look_ahead(self, perturbed: bool) -> bool:
        """Whether block i + 1 is prepared before the forward through block i (work division)."""
        return False

    # --- the stage loop -----------------------------------------------------------------------------

    def _noise(self, step: int, plan: Sequence[Probe]) -> StageNoise:
        return StageNoise(self.directions, self.workspace, step, self.eps, plan, self.timers)

    def forward_arithmetic(self):
        """engine.compute=bf16: the forward under bfloat16 autocast. Weights, working copies and
        the update stay in the master's dtype (the chunk pass has no autocast op), so only the
        forward's products round to bfloat16."""
        if self.compute == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    @torch.inference_mode()
    def _run(self, parts: Sequence[Sequence[Packed]], plan: Sequence[Probe], step: int,
             full_plan: Sequence[Probe] | None) -> list[Scores]:
        with self.forward_arithmetic():
            return self._walk(parts, plan, step, full_plan)

    def _walk(self, parts: Sequence[Sequence[Packed]], plan: Sequence[Probe], step: int,
              full_plan: Sequence[Probe] | None) -> list[Scores]:
        """Scores of every probe of `plan`: probe e on the packed micro-batches parts[e]
        (usually the same batch for every probe; decoding gives each its own). One walk: each
        block's noise is drawn once and every micro-batch of every probe passes through the block
        before the next, so memory inside a block scales with a micro-batch while the hidden states
        between blocks are the whole shard's (small). full_plan: the step's whole plan (work division
        builds the copies of the node's other ranks too)."""
        contexts = {id(p): self.adapter.context(p.input_ids, p.position_ids, mask_fn=p.mask_fn())
                    for ps in parts for p in ps}
        perturbed = any(ev.perturbed for ev in plan)

        def stage_views(noise: StageNoise, sources=None) -> list:
            clean = CleanWeights(self.model, sources)
            return [PerturbedWeights(self.model, self.params, noise, i, sources) if ev.perturbed else clean
                    for i, ev in enumerate(plan)]

        self._before_write()
        self._pay_outer_if_owed()
        hidden = [[self.adapter.stem(contexts[id(p)], w) for p in ps]
                  for ps, w in zip(parts, stage_views(self._noise(step, plan)))]
        blocks = len(self.adapter.blocks)
        ahead = self._look_ahead(perturbed)
        next_noise = None
        for i in range(blocks):
            with self.block_sources(i) as sources:
                noise = next_noise or self._prepare_block(i, sources, step, plan, perturbed, full_plan)
                noise.ready()
                # Look-ahead implies resident weights, so the block ahead has no `sources`.
                next_noise = (self._prepare_block(i + 1, None, step, plan, perturbed, full_plan)
                              if ahead and i + 1 < blocks else None)
                hidden = [[self.adapter.block(i, h, contexts[id(p)], w) for h, p in zip(hs, ps)]
                          for hs, ps, w in zip(hidden, parts, stage_views(noise, sources))]
        scores = [join_scores([self._head(h, p, w) for h, p in zip(hs, ps)])
                  for hs, ps, w in zip(hidden, parts, stage_views(self._noise(step, plan)))]
        self._after_walk(perturbed)
        return scores

    def _head(self, hidden: torch.Tensor, packed: Packed, w) -> Scores:
        """The final stage at the scored positions only (the scoring contract, distzo/data/batches.py)."""
        features = self.adapter.final(hidden[packed.score_row, packed.score_col], w)
        return head_scores(self.adapter, features, packed, w)


class ResidentEngine(StagedEngine):
    """Every weight on the compute device: the stage loop as it is."""

    mode = "resident"


def join_scores(parts: Sequence[Scores]) -> Scores:
    """The Scores of consecutive micro-batches as one (their units follow one another)."""
    if len(parts) == 1:
        return parts[0]
    logits = None if parts[0].logits is None else torch.cat([s.logits for s in parts])
    return Scores(torch.cat([s.nll for s in parts]), torch.cat([s.count for s in parts]), logits)


def head_scores(adapter: DecoderAdapter, features: torch.Tensor, packed: Packed, w) -> Scores:
    """Scores from the final features of the scored positions: candidate logits where asked (one
    scored position per unit), and per unit the summed -log p(target) of its target positions, the
    log-probability normalised over the whole vocabulary (HEAD_ROWS positions at a time). Logits
    are taken in at least float32 for the loss."""
    device = features.device
    nll = torch.zeros(packed.units, dtype=torch.float64, device=device)
    count = torch.zeros(packed.units, dtype=torch.float64, device=device)
    logits = None
    has_target = packed.score_target != NO_TARGET
    if packed.candidates is not None:
        at = (~has_target).nonzero().view(-1)
        out = adapter.head(features[at] if at.numel() != features.shape[0] else features, packed.candidates, w)
        out = out.to(torch.promote_types(out.dtype, torch.float32))
        logits = out.new_zeros((packed.units, out.shape[1]))
        logits[packed.score_unit[at]] = out
    targets = has_target.nonzero().view(-1)
    for lo in range(0, targets.numel(), HEAD_ROWS):
        sel = targets[lo:lo + HEAD_ROWS]
        full = adapter.head(features[sel], None, w)
        logp = torch.log_softmax(full.to(torch.promote_types(full.dtype, torch.float32)), dim=-1)
        picked = logp.gather(1, packed.score_target[sel, None])[:, 0]
        nll.index_add_(0, packed.score_unit[sel], -picked.double())
    if targets.numel():
        count.index_add_(0, packed.score_unit[targets], torch.ones(targets.numel(), dtype=torch.float64, device=device))
    return Scores(nll, count, logits)
