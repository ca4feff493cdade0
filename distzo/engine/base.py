"""The stage loop every engine shares: stem -> blocks -> final + head, all evaluations per stage.

For each stage the engine draws the stage's z once per query and runs every evaluation of the step
through that stage before moving on, so the + and - passes share one noise generation (ZO2's
"dual forward", generalised to any plan).

Updates are deferred (DESIGN I5): `update` records the step's update, and the next step applies it
to each stage as the stage comes up, fused chunk by chunk with that stage's perturbation (one pass
over the weights instead of two). `flush` applies whatever is still owed; evaluation, replica
checks, snapshots and the end of training call it. Engines differ only in where a block's weights
are while it computes (`block_sources`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence

import torch
from torch import nn

from ..data.tasks import Batch
from ..models.adapters import DecoderAdapter
from ..timing import DISABLED
from ..zo.directions import Directions
from ..zo.estimators import CLEAN, Evaluation
from ..zo.params import TrainableParam, TrainableParams
from .division import STAGE_SLOTS, Arrival, WorkDivision
from .update import PendingUpdate, apply_update
from .weights import CleanWeights, PerturbedWeights, StageNoise, Workspace

OUTER = "outer"  # the stage of every trainable parameter outside the blocks (embeddings, norms, head)


class StagedEngine:
    """Evaluates a step's plan stage by stage; subclasses place the block weights."""

    def __init__(self, model: nn.Module, adapter: DecoderAdapter, params: TrainableParams, directions: Directions,
                 row_tokens: int = 1024):
        for p in params:
            if not p.tensor.is_contiguous():
                raise ValueError(f"parameter {p.name} is not contiguous; the chunked update needs flat views")
        self.model, self.adapter, self.params, self.directions = model, adapter, params, directions
        self.device = directions.device
        self.row_tokens = row_tokens
        self.workspace = Workspace(self.device)
        self.timers = DISABLED  # the bench command swaps in enabled timers
        self.block_params = [[p for p in params if p.name.startswith(prefix + ".")] for prefix, _ in adapter.blocks]
        in_blocks = {p.name for ps in self.block_params for p in ps}
        self.outer_params = [p for p in params if p.name not in in_blocks]
        self.pending: PendingUpdate | None = None
        self.fuse_update = True  # apply an owed update inside the next perturbation pass
        # True when streaming a block involves collectives over the node (sliced offloading): then a
        # rank with no evaluation this step must still walk every block with its peers.
        self.collective_blocks = False
        # The node's ranks share the master and divide noise and update work (engine/division.py).
        self.division: WorkDivision | None = None
        # P-RGE: None, or "materialize" / "on_the_fly": a rank's perturbed evaluations run as one
        # batched forward over stacked LoRA B copies (`distzo.engine.stacked`).
        self.stacked_lora: str | None = None
        # Divided: announced when this rank's last perturbed evaluation has read the shared master
        # for the last time; every write to the master first waits until all peers announced it.
        self._reads_done: Arrival | None = None

    # --- where block weights are ----------------------------------------------------------------------

    @contextmanager
    def block_sources(self, i: int) -> Iterator[Mapping[str, torch.Tensor] | None]:
        """The tensors holding block i's parameters on the compute device while it computes (None:
        the parameters themselves)."""
        yield None

    def transfer_stats(self) -> dict[str, float]:
        """Cumulative bytes this rank moved host-to-device, back, and from node peers (sliced
        offloading), and seconds spent in those transfers; all zero when nothing is offloaded."""
        return {"h2d_bytes": 0, "d2h_bytes": 0, "peer_bytes": 0, "transfer_s": 0.0}

    def host_master_bytes(self) -> dict[str, int]:
        """Host memory of the offloaded master: `copy` (one copy of it) and `resident` (what this
        rank holds resident of it: its share of a node-shared master); zeros when not offloading."""
        return {"copy": 0, "resident": 0}

    # --- deferred updates ------------------------------------------------------------------------------

    def update(self, step: int, coefficients: Sequence[tuple[int, float]], lr: float, weight_decay: float) -> None:
        """theta -= lr * (sum_k c_k z_k + weight_decay * theta), applied as each stage next comes up
        (fused into its perturbation with fuse_update, otherwise in a pass of its own)."""
        self.flush()  # a rank without evaluations never streamed the previous one
        stages = {OUTER, *range(len(self.block_params))}
        self.pending = PendingUpdate(step, tuple(coefficients), lr, weight_decay, stages)

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

    def _peers_done_reading(self) -> None:
        """Divided: before this rank changes the shared master, every peer has finished the evaluation
        that read it (a training step's loss exchange already ensures this; the engine does not rely
        on its caller for it)."""
        if self._reads_done is not None:
            with self.timers("wait"):
                self._reads_done.wait()
            self._reads_done = None

    @torch.inference_mode()
    def flush(self) -> None:
        """Apply the deferred update to every stage that still owes it (DESIGN I5)."""
        if self.pending is None:
            return
        self._peers_done_reading()
        with self.timers("update"):
            self._apply_outer()
            for i in range(len(self.block_params)):
                if self.owes(i):
                    self._flush_block(i)
            self.after_flush()

    def _flush_block(self, i: int) -> None:
        with self.block_sources(i) as sources:
            u = self.take_pending(i)
            if u is not None:
                apply_update(self.directions, self._targets(i, sources), u, division=self.division)

    def after_flush(self) -> None:
        """Hook: wait for anything asynchronous a flush started (divided: for the node's peers)."""
        if self.division is not None:
            self.division.barrier()

    @contextmanager
    def local_reads(self) -> Iterator[None]:
        """Hook: the forwards inside read the (flushed) master without collectives (evaluation,
        where ranks run different numbers of batches)."""
        yield

    def _apply_outer(self) -> None:
        u = self.take_pending(OUTER)
        if u is not None:
            apply_update(self.directions, [(p, p.tensor) for p in self.outer_params], u, division=self.division)
            if self.division is not None:
                self.division.barrier()  # the peers' chunks are updated before anyone reads them

    def _targets(self, i: int, sources) -> list[tuple[TrainableParam, torch.Tensor]]:
        sources = sources or {}
        return [(p, sources.get(p.name, p.tensor)) for p in self.block_params[i]]

    # --- the stage loop ------------------------------------------------------------------------------

    @torch.inference_mode()
    def label_logits(self, batch: Batch, label_ids: torch.Tensor, plan: Sequence[Evaluation],
                     step: int, eps: float, node_plan: Sequence[Evaluation] | None = None) -> torch.Tensor:
        """Label-word logits [len(plan), B, C] of every evaluation of the plan on one batch.

        An empty plan computes nothing; with `collective_blocks` it still streams every block with
        the node's peers (and pays the deferred update), as a rank without evaluations must.
        node_plan: the evaluations any rank of this node runs this step; with work division this
        rank builds its share of every working copy they need, for its peers as well as for itself."""
        label_ids = label_ids.to(self.device)
        if self.stacked_lora is not None and any(ev.perturbed for ev in plan):
            from .stacked import stacked_label_logits

            return stacked_label_logits(self, batch, label_ids, plan, step, eps, self.stacked_lora == "materialize")
        if not plan:
            if self.collective_blocks:
                for i in range(len(self.adapter.blocks)):
                    with self.block_sources(i):
                        pass
            return torch.empty(0, batch.size, label_ids.numel(), device=self.device)
        packed = batch.pack(self.row_tokens).to(self.device)
        ctx = self.adapter.context(packed.input_ids, packed.position_ids)
        perturbed = any(ev.perturbed for ev in plan)
        node_evals = sorted({(ev.query, ev.sign) for ev in (node_plan or plan) if ev.perturbed})

        def stage_views(noise: StageNoise, sources=None) -> list:
            clean = CleanWeights(self.model, sources)
            return [PerturbedWeights(self.model, self.params, noise, i, sources) if ev.perturbed else clean
                    for i, ev in enumerate(plan)]

        self._peers_done_reading()
        if self.owes(OUTER):
            with self.timers("update"):
                self._apply_outer()
        hidden = [self.adapter.stem(ctx, w) for w in stage_views(self._noise(step, eps, plan))]
        blocks = len(self.adapter.blocks)
        # Divided work: a rank builds its share of block i+1 between its wait for block i and its
        # forward through block i, so its peers' jitter is absorbed (engine/division.py). Division
        # implies resident weights, so the block ahead has no `sources`.
        ahead = self.division is not None and perturbed
        next_noise = None
        for i in range(blocks):
            with self.block_sources(i) as sources:
                noise = next_noise or self._prepare_block(i, sources, step, eps, plan, perturbed, node_evals)
                noise.ready()
                next_noise = (self._prepare_block(i + 1, None, step, eps, plan, perturbed, node_evals)
                              if ahead and i + 1 < blocks else None)
                hidden = [self.adapter.block(i, h, ctx, w) for h, w in zip(hidden, stage_views(noise, sources))]
        logits = []
        for h, w in zip(hidden, stage_views(self._noise(step, eps, plan))):
            features = self.adapter.final(h[packed.last_row, packed.last_col], w)
            out = self.adapter.head(features, label_ids, w)
            logits.append(out.to(torch.promote_types(out.dtype, torch.float32)))  # >= fp32 for the loss
        if ahead:  # every rank of the node runs perturbed evaluations in step with its peers
            self._reads_done = self.division.arrive()
        return torch.stack(logits)

    def _prepare_block(self, i: int, sources, step: int, eps: float, plan: Sequence[Evaluation], perturbed: bool,
                       node_evals: Sequence[tuple[int, int]]) -> StageNoise:
        """Pay block i's owed update and build its working copies (divided: this rank's share, still
        to be awaited with `ready`)."""
        noise = self._noise(step, eps, plan)
        u = self.take_pending(i)
        if u is not None and not perturbed and self.division is not None:
            # divided, this rank would update only its own chunks and then read the whole block with no
            # handshake; every clean forward flushes first (`clean_label_logits`), which keeps this unreachable
            raise RuntimeError("internal error: a clean forward on a divided engine still owes an update; flush first")
        if u is not None and not (perturbed and self.fuse_update):
            with self.timers("update"):
                apply_update(self.directions, self._targets(i, sources), u, division=self.division)
            u = None
        if perturbed:  # an owed update still in hand is fused into this block's perturbation
            noise.prepare(self.block_params[i], lambda p, s=sources: (s or {}).get(p.name, p.tensor), u,
                          division=self.division, slot=i % STAGE_SLOTS, node_evals=node_evals)
        return noise

    def _noise(self, step: int, eps: float, plan: Sequence[Evaluation]) -> StageNoise:
        return StageNoise(self.directions, self.workspace, step, eps, plan, self.timers)

    def clean_label_logits(self, batch: Batch, label_ids: torch.Tensor) -> torch.Tensor:
        """Label-word logits [B, C] at the master weights (deferred updates applied first)."""
        self.flush()
        with self.local_reads():
            return self.label_logits(batch, label_ids, [Evaluation(CLEAN, 0)], step=0, eps=0.0)[0]
