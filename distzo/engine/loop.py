"""The step loop every engine mode runs: stem -> blocks -> final + head, all probes per stage.

For each stage the loop draws the stage's z once per query and runs every probe of the step through
that stage before moving on, so the + and - passes share one noise generation (ZO2's "dual
forward", generalised to any plan). What differs between the modes is not this loop but the parts
it is built with (docs/architecture.md#engines):

- a **store** (`distzo.engine.stores.WeightStore`): where the master lives and how block i becomes
  the tensors a forward reads on this rank: the parameters themselves (resident), a node-shared
  master, a host master streamed through device slots (offloaded), or a node-shared host master of
  which each rank moves a slice (sliced);
- a **division** (`Division`): which of the node's ranks builds which chunks of a stage's working
  copies and updates (all of them here: `Division`; a node's ranks sharing the work:
  `distzo.engine.divided.NodeDivision`);
- the optimizer's **rule**, carried by the pending update (`distzo.engine.pending`);
- optionally P-RGE's **stacked probes** (`distzo.engine.stacked`), which run a rank's perturbed
  probes in one forward.

The update is deferred (docs/architecture.md#invariants, I5): `apply` records it as a pending update,
and the next walk applies it to each stage as the stage comes up, fused chunk by chunk with that
stage's perturbation (`update_stage`, the one function every store reaches). `materialized`
applies whatever is still pending before anything reads the weights.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch
from torch import nn

from ..data.batches import NO_TARGET, Batch, Packed, Scores
from ..models.adapters import DecoderAdapter
from ..models.kv_cache import DecodeKV
from ..parallel.mesh import Mesh
from ..telemetry.timing import DISABLED, Timers
from ..zo.directions import Directions
from ..zo.estimators import CLEAN, Probe
from ..zo.optimizers import SGD, Optimizer
from ..zo.params import TrainableParams
from .base import Engine, Materialized, ParametersReplaced, parameter_storage
from .copystream import SLOTS, CopyStreams, SideStreamNoise
from .decoding import Decoder
from .pending import PendingUpdate, Target, apply_pending
from .stores import OUTER, WeightStore
from .weights import CleanWeights, PerturbedWeights, StageNoise, Workspace

if TYPE_CHECKING:
    from .stacked import StackedProbes

DIRECTIONS_STATE = "directions/"  # the prefix of the directions' state among a snapshot's state tensors
SCALAR_STATE = "scalars/"  # the prefix of the optimizer's host numbers (MEAZO's second moment) among them
HEAD_ROWS = 256  # scored positions per full-vocabulary head product (bounds its [rows, vocab] temporary)


class Division:
    """Every rank builds every chunk of the stages it walks and applies every update itself. The
    hooks are where a node's ranks sharing that work (`distzo.engine.divided.NodeDivision`) hand
    over to one another; here they do nothing."""

    # Keeps the update's chunks this rank owns among its node's ranks (None: all of them).
    mine: Callable | None = None
    # Whether a walk waits on the node's other ranks (a walk that fails halfway strands them).
    with_peers = False

    def stage_noise(self, loop: StageLoop, i: int, step: int, plan: Sequence[Probe], perturbed: bool,
                    full_plan: Sequence[Probe] | None) -> StageNoise:
        """The object that builds block i's working copies for `plan`."""
        return loop.noise(step, plan, block=i)

    def before_write(self) -> None:
        """Before this rank writes the master outside a block's pass (peers may still read it)."""

    def after_outer_update(self) -> None:
        """After the outer stage's update (peers' shares must land before anyone reads them)."""

    def after_flush(self) -> None:
        """After a flush's updates."""

    def after_walk(self, perturbed: bool) -> None:
        """After a walk's last stage."""

    def look_ahead(self, perturbed: bool) -> bool:
        """Whether block i + 1's copies are built before the forward through block i."""
        return False

    def check_clean(self, awaits: bool) -> None:
        """A clean forward reaches a block (`awaits`: it still awaits the pending update)."""

    def describe(self) -> str:
        return ""


class StageLoop(Engine):
    """The engine: the stage loop over a store (see the module docstring).

    eps: the perturbation scale; mesh: which probes of a plan this rank runs (a 1x1 mesh when None);
    fuse_update: apply a pending update inside the next perturbation pass (False: in a pass of its
    own, for comparison); micro_batch_size: examples of a rank's shard per forward (None: the whole
    shard at once; see `_walk`); compute: the forward's arithmetic (`engine.compute`); timers: phase
    timers (`bench`); optimizer: the update rule and its state (sgd when None), whose state the
    store holds where it holds the master; store / division / stacked: the mode's parts;
    copy_stream: build each block's copies one block ahead on a second CUDA stream
    (`distzo.engine.copystream`; resident weights only); decode_cache: engine.decode_cache, how a
    decoding objective's answers keep keys and values across their walks (`distzo.engine.decoding`)."""

    def __init__(self, model: nn.Module, adapter: DecoderAdapter, params: TrainableParams, directions: Directions,
                 store: WeightStore, *, division: Division | None = None, stacked: StackedProbes | None = None,
                 eps: float = 1e-3, mesh: Mesh | None = None, row_tokens: int = 1024, fuse_update: bool = True,
                 micro_batch_size: int | None = None, compute: str = "fp32", timers: Timers = DISABLED,
                 optimizer: Optimizer | None = None, mode: str = "resident", copy_stream: bool = False,
                 decode_cache: str = "auto"):
        self.model, self.adapter, self.params, self.directions = model, adapter, params, directions
        self.device = directions.device
        self.eps, self.row_tokens, self.fuse_update, self.timers = float(eps), row_tokens, fuse_update, timers
        self.micro_batch_size, self.compute, self.mode = micro_batch_size, compute, mode
        self.mesh = mesh if mesh is not None else Mesh.single(self.device)
        self.optimizer = optimizer if optimizer is not None else SGD()
        self.workspace = Workspace(self.device)
        self.store = store
        self.division = division if division is not None else Division()
        self.stacked = stacked
        self.copy_streams = CopyStreams(self.device) if copy_stream else None
        self.pending: PendingUpdate | None = None
        store.attach(self)
        self.decoder = Decoder(self, decode_cache)

    def describe(self) -> str:
        parts = [self.store.describe(), self.division.describe(), self.stacked.describe() if self.stacked else "",
                 "copies built one block ahead on a second CUDA stream" if self.copy_streams is not None else ""]
        return ", ".join(p for p in parts if p)

    # --- the interface ------------------------------------------------------------------------------

    def run_probes(self, batch: Batch, plan: Sequence[Probe], step: int) -> dict[int, Scores]:
        if batch.readout == "decode":
            return self.decoder.run(batch, plan, step)
        mine = self.mesh.my_probes(len(plan))
        if not mine:
            if self.store.walks_with_peers:
                self._walk_with_peers()
            return {}
        parts = [self.pack(b).to(self.device) for b in batch.micro_batches(self.micro_batch_size)]
        scores = self._run([parts] * len(mine), [plan[i] for i in mine], step, plan)
        return dict(zip(mine, scores))

    def begin_step(self, step: int) -> None:
        if self.directions.refreshes_at(step):
            with self.materialized() as weights:
                self.directions.refresh(step, weights.params)
            # Every rank has read the master before any writes it again: where the node's ranks share
            # it (divided, sliced), a peer re-applying logged steps (resume) would otherwise update it
            # under a rank still reading; a training step's loss exchange would not come in time.
            self.mesh.barrier()

    def apply(self, step: int, coefficients: Sequence[tuple[int, float]], lr: float, weight_decay: float) -> None:
        """Records the update as pending for every stage (docs/architecture.md#engines)."""
        self.flush()  # a rank without probes never walked the previous update through its blocks
        stages = {OUTER, *range(self.store.blocks)}
        self.pending = PendingUpdate(step, tuple(coefficients), lr, weight_decay,
                                     self.optimizer.rule(step, lr, weight_decay, coefficients), stages,
                                     self.directions)

    @contextmanager
    def materialized(self) -> Iterator[Materialized]:
        self.flush()
        with self.store.local_reads():
            held = parameter_storage(self.model)
            yield Materialized(self)
            if parameter_storage(self.model) != held:
                # The stores update the tensors they were built on (or views of them), and the next
                # forward would read the new ones: the run would silently train one copy and evaluate
                # another.
                raise ParametersReplaced(
                    "the model's parameters were given new tensors while distzo's engine held them (a "
                    "model.to(...), a cast such as model.half(), or a wrapper that moves the model, called "
                    "while reading the weights mid-run); the engine keeps updating the tensors it was built "
                    "on, so training and evaluation would part ways: move, cast or wrap the model before "
                    "training starts")

    def pack(self, batch: Batch) -> Packed:
        return batch.pack(self.row_tokens, self.adapter.attention_window)

    def score_clean(self, batch: Batch) -> Scores:
        if self.pending is not None:
            raise RuntimeError("internal error: a clean score outside `materialized()` (an update is still pending)")
        packed = self.pack(batch).to(self.device)
        return self._run([[packed]], [Probe(CLEAN, 0)], 0, None)[0]

    def forward_arithmetic(self):
        """engine.compute=bf16: the forward under bfloat16 autocast. Weights, working copies and
        the update stay in the master's dtype (the chunk pass has no autocast op), so only the
        forward's products round to bfloat16."""
        if self.compute == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def stock_forward(self):
        return self.store.stock_forward()

    def transfer_stats(self) -> dict[str, float]:
        return self.store.transfer_stats()

    def host_master_bytes(self) -> dict[str, int]:
        return self.store.host_master_bytes()

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """The optimizer's state (its per-element slots, and its host numbers under `scalars/`), and
        what the directions keep between steps (LOZO-M's factors, Sparse MeZO's thresholds) under
        `directions/`."""
        own = {f"{DIRECTIONS_STATE}{k}": v for k, v in self.directions.state().items()}
        scalars = ({f"{SCALAR_STATE}{k}": v for k, v in self.optimizer.scalar_state().items()}
                   if self.optimizer.scalars else {})
        return {**self.store.optimizer_state(), **own, **scalars}

    def load_optimizer_state(self, tensors) -> None:
        def under(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

        self.directions.load_state(under(DIRECTIONS_STATE))
        if self.optimizer.scalars:
            self.optimizer.load_scalar_state(under(SCALAR_STATE))
        self.store.load_optimizer_state({k: v for k, v in tensors.items()
                                         if not k.startswith((DIRECTIONS_STATE, SCALAR_STATE))})

    def optimizer_state_bytes(self) -> dict[str, int]:
        extra = self.directions.state_bytes()
        return {"copy": self.optimizer.state_bytes(self.params.numel()) + extra,
                "resident": self.store.state_resident_bytes() + extra}

    def close(self) -> None:
        self.decoder.close()
        self.store.close()

    # --- the pending update -------------------------------------------------------------------------

    def awaits(self, stage) -> bool:
        """Whether `stage` still awaits the pending update."""
        return self.pending is not None and self.pending.awaits(stage)

    def update_stage(self, stage, targets: Sequence[Target], noise: StageNoise | None = None) -> None:
        """Apply the pending update `stage` awaits, if any, to `targets` (the stage's masters where the
        store holds them now): the one place every pending update is applied. With `noise`, the
        stage's working copies are built too, and the update is fused into that pass; it runs in a
        pass of its own without `noise`, with `fuse_update` off, or where the targets record their
        change as deltas (which the fused pass does not write). The division keeps the chunks this
        rank owns where the node's ranks share the work."""
        u = self.pending if self.awaits(stage) else None
        if u is not None:
            u.stages.discard(stage)
            if not u.stages:
                self.pending = None
        if u is not None and (noise is None or not self.fuse_update or any(t.delta is not None for t in targets)):
            with self.timers("update"):
                apply_pending(self.directions, targets, u, mine=self.division.mine)
            u = None
        if noise is not None:  # an update still in hand is fused into this stage's perturbation
            masters = {t.param.name: t.tensor for t in targets}
            states = {t.param.name: t.state for t in targets}
            noise.prepare([t.param for t in targets], lambda p: masters[p.name], u, lambda p: states[p.name])
        if stage == OUTER:
            self.division.after_outer_update()

    @torch.inference_mode()
    def flush(self) -> None:
        """Apply the pending update to every stage that still awaits it (I5)."""
        if self.pending is None:
            self.store.synchronize()  # nothing pending, but copies of the last walk may still be in flight
            return
        self.division.before_write()
        with self.timers("update"):
            self.update_stage(OUTER, self.store.outer_targets())
            for i in range(self.store.blocks):
                if self.awaits(i):
                    self.store.flush_block(i)
            self.store.synchronize()
            self.store.after_flush()
            self.division.after_flush()

    def _update_outer(self) -> None:
        """The outer stage's pending update, at the start of a walk."""
        if self.awaits(OUTER):
            with self.timers("update"):
                self.update_stage(OUTER, self.store.outer_targets())

    def _walk_with_peers(self) -> None:
        """A rank dealt no probe walks the blocks anyway (applying the pending update) where its
        peers need it to (`WeightStore.walks_with_peers`). It updates the outer stage too, as `_walk`
        does, so that afterwards every rank awaits the same stages: `flush` enters its collectives
        only when something is pending, and ranks that disagreed on that would wait on different
        collectives."""
        self.division.before_write()
        self._update_outer()
        for i in range(self.store.blocks):
            with self.store.block(i):
                pass

    # --- the stage loop -----------------------------------------------------------------------------

    def noise(self, step: int, plan: Sequence[Probe], block: int | None = None) -> StageNoise:
        """The object that builds a stage's working copies (block: a decoder block's index, None for
        the outer stage); with `copy_stream`, a block's are built on the copy stream."""
        if block is not None and self.copy_streams is not None:
            return SideStreamNoise(self.directions, self.workspace, step, self.eps, plan, self.timers,
                                   streams=self.copy_streams, slot=block % SLOTS, **self.shaping())
        return StageNoise(self.directions, self.workspace, step, self.eps, plan, self.timers, **self.shaping())

    def shaping(self) -> dict:
        """StageNoise's `shaper` and `state_of` (the outer stage's state, for copies built on first
        use) where the optimizer's state shapes the directions (HiZOO); nothing otherwise."""
        if not self.optimizer.shapes_directions:
            return {}
        states = {t.param.name: t.state for t in self.store.outer_targets()}
        return {"shaper": self.optimizer, "state_of": lambda p: states[p.name]}

    def _prepare_block(self, i: int, targets: Sequence[Target], step: int, plan: Sequence[Probe], perturbed: bool,
                       full_plan: Sequence[Probe] | None) -> StageNoise:
        """Block i's working copies (none for a clean walk), its pending update applied on the way."""
        if not perturbed:
            self.division.check_clean(self.awaits(i))
        noise = self.division.stage_noise(self, i, step, plan, perturbed, full_plan)
        self.update_stage(i, targets, noise if perturbed else None)
        return noise

    @torch.inference_mode()
    def _run(self, parts: Sequence[Sequence[Packed]], plan: Sequence[Probe], step: int,
             full_plan: Sequence[Probe] | None, caches: Sequence[DecodeKV] | None = None) -> list[Scores]:
        with self.forward_arithmetic():
            perturbed = any(ev.perturbed for ev in plan)
            if self.stacked is not None and perturbed:
                return self.stacked.run(self, parts, plan, step)
            if self.copy_streams is None or not perturbed:
                return self._walk(parts, plan, step, full_plan, caches)
            with self.copy_streams.walk() as keep:
                scores = self._walk(parts, plan, step, full_plan, caches)
                for t in (t for sc in scores for t in (sc.nll, sc.count, sc.logits) if t is not None):
                    keep(t)
            return scores

    def _walk(self, parts: Sequence[Sequence[Packed]], plan: Sequence[Probe], step: int,
              full_plan: Sequence[Probe] | None, caches: Sequence[DecodeKV] | None = None) -> list[Scores]:
        """Scores of every probe of `plan`: probe e on the packed micro-batches parts[e]
        (usually the same batch for every probe; decoding gives each its own). One walk: each
        block's noise is drawn once and every micro-batch of every probe passes through the block
        before the next, so memory inside a block scales with a micro-batch while the hidden states
        between blocks are the whole shard's (small). full_plan: the step's whole plan (work division
        builds the copies of the node's other ranks too). caches: probe e's attention layers keep
        and read their keys and values in caches[e] (a decoding walk, `distzo.engine.decoding`)."""
        contexts = {id(p): self.adapter.context(p.input_ids, p.position_ids, mask_fn=p.mask_fn())
                    for ps in parts for p in ps}
        perturbed = any(ev.perturbed for ev in plan)
        attend = self.decoder.attending(caches)

        def stage_views(noise: StageNoise, sources=None) -> list:
            clean = CleanWeights(self.model, sources)
            return [PerturbedWeights(self.model, self.params, noise, i, sources) if ev.perturbed else clean
                    for i, ev in enumerate(plan)]

        self.division.before_write()
        self._update_outer()
        hidden = [[attend(e, self.adapter.stem, contexts[id(p)], w) for p in ps]
                  for e, (ps, w) in enumerate(zip(parts, stage_views(self.noise(step, plan))))]
        blocks = self.store.blocks
        ahead = self.division.look_ahead(perturbed) or (perturbed and self.copy_streams is not None)
        next_noise = None
        for i in range(blocks):
            with self.store.block(i) as block:
                noise = next_noise or self._prepare_block(i, block.targets, step, plan, perturbed, full_plan)
                noise.ready()
                # Look-ahead implies resident weights: block i + 1's targets are its parameters.
                next_noise = (self._prepare_block(i + 1, self.store.resident_targets(i + 1), step, plan, perturbed,
                                                  full_plan) if ahead and i + 1 < blocks else None)
                hidden = [[attend(e, self.adapter.block, i, h, contexts[id(p)], w) for h, p in zip(hs, ps)]
                          for e, (hs, ps, w) in enumerate(zip(hidden, parts, stage_views(noise, block.sources)))]
        scores = [join_scores([self.head(h, p, w) for h, p in zip(hs, ps)])
                  for hs, ps, w in zip(hidden, parts, stage_views(self.noise(step, plan)))]
        self.division.after_walk(perturbed)
        return scores

    def head(self, hidden: torch.Tensor, packed: Packed, w) -> Scores:
        """The final stage at the scored positions only (the scoring contract, distzo/data/batches.py)."""
        features = self.adapter.final(hidden[packed.score_row, packed.score_col], w)
        return head_scores(self.adapter, features, packed, w)


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
        whole = packed.whole_vocabulary
        # Every vocabulary id in order (decoding's argmax): the head's whole table, as the token loss
        # reads it (one working copy by chunk passes, not a gather of every row and its z).
        out = adapter.head(features[at] if at.numel() != features.shape[0] else features,
                           None if whole else packed.candidates, w)
        if whole:
            out = out[:, :packed.candidates.numel()]  # a head padded beyond the vocabulary: its extra columns dropped
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
