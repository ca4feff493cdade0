"""ZO2-style offloading: decoder blocks live in host memory and stream through the compute device.

Embeddings, final norm and LM head stay on the device. Each block's parameters are re-pointed
into one flat host buffer (pinned on CUDA), the master copy. Every step, each block is uploaded
once into a slot of a small ring of preallocated device buffers, receives the previous step's
deferred update, serves all of the rank's probes, and, if it was updated, goes back to the
host master. On CUDA, uploads and write-backs run on their own streams and are ordered against the
compute stream with events (ZO2's Algorithm 2), so block i+1 uploads and block i-1 writes back
while block i computes. On CPU the same code runs with host-to-host copies.

The pending update reaches the uploaded copy (`StageLoop.update_stage`, fused with the block's
perturbation), so offloaded and resident training agree bitwise. With `transfer_dtype`
(bf16/fp16) a block travels at reduced precision and is widened on the device; the host keeps the
full-precision master and receives the update as a reduced-precision delta (4 bytes a parameter per
step instead of 8 for a full-precision round trip, and no update is lost to rounding the master).

Sliced communication (DistZO2 §6.1, `comm.sliced=true` with several ranks on a node): the node
keeps ONE host master, in memory every local rank maps (`distzo.parallel.node`), laid out so that local
rank j owns slice j of every block (equal, aligned, contiguous ranges: DistZO2's thread-aligned
partitioning). For each block a rank uploads only its slice, applies the pending update to that
slice alone (so the node's ranks share the update's noise regeneration), writes that slice back,
and all-gathers the other slices from its peers over the node group (NCCL, so NVLink, on GPUs;
gloo on CPU). Per block and step a rank moves 1/n of the block over the host link each way instead
of all of it; the rest crosses the peer links. Every element still receives exactly the
operations of the resident update, so the weights stay bitwise the same.

An optimizer with state keeps the blocks' state beside their host master (node-shared with it on
the sliced path) and streams it with the blocks that await an update (`streamer`); the outer stage's
state stays on the device with the outer stage.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator, Mapping

import torch
from torch import nn

from ..models.adapters import DecoderAdapter
from ..parallel.node import Node, mapped_resident_bytes
from ..registry import register
from ..zo.optimizers import SGD, Optimizer
from ..zo.params import TrainableParams
from .build import EngineMode, EngineSetup
from .loop import StageLoop
from .optstate import StateBuffers, state_key
from .pending import Target
from .stores import Block, WeightStore
from .streamer import (
    BlockStreamer,
    SlicedBlockStreamer,
    build_host_blocks,
    place_resident,
    streamed_stock_forward,
)


class OffloadStore(WeightStore):
    """Blocks in host memory (one master per rank), streamed whole through the device slot ring; the
    outer stage (and its optimizer state) on the device."""

    def __init__(self, model: nn.Module, adapter: DecoderAdapter, params: TrainableParams, optimizer: Optimizer,
                 device: torch.device, *, slots: int = 3, transfer_dtype: torch.dtype | None = None):
        self.host_blocks = build_host_blocks(adapter, pin_memory=device.type == "cuda", node=self._shared_node(),
                                             state_slots=len(optimizer.slots), state_initial=optimizer.initial)
        place_resident(model, device, (n for b in self.host_blocks for n in b.names))
        super().__init__(adapter, params, optimizer, device)
        self.state = StateBuffers(optimizer.slots, self.outer_params, device, initial=optimizer.initial)
        self.streamer = self._build_streamer(slots, transfer_dtype)

    def _shared_node(self) -> Node | None:
        """The node whose ranks share one host master (sliced), or None (a master of its own)."""
        return None

    def _build_streamer(self, slots: int, transfer_dtype: torch.dtype | None) -> BlockStreamer:
        return BlockStreamer(self.host_blocks, self.device, slots, transfer_dtype, awaits=self._awaits,
                             state_needed=self._state_needed)

    def _awaits(self, i: int) -> bool:
        return self.loop is not None and self.loop.awaits(i)

    def _state_needed(self, i: int) -> bool:
        """Block i's optimizer state goes up with it: for its pending update, or, where the state
        shapes the directions (HiZOO), for its copies."""
        return self._awaits(i) or self.optimizer.shapes_directions

    def outer_targets(self) -> list[Target]:
        return [Target(p, p.tensor, state=self.state.of(p)) for p in self.outer_params]

    @contextmanager
    def block(self, i: int) -> Iterator[Block]:
        """Upload block i (prefetching the next ones), let it compute, write it back if it awaited the
        update (applied on the slot meanwhile)."""
        updated = self._awaits(i)
        with self.loop.timers("transfer"):
            self.streamer.prefetch_from(i)
            views = self.streamer.acquire(i)
        try:
            yield Block(views, self._targets(i, views))
        finally:
            with self.loop.timers("transfer"):
                self.streamer.release(i, write_back=updated)

    def _targets(self, i: int, views: Mapping[str, torch.Tensor]) -> list[Target]:
        """Block i's masters in its slot; at reduced precision each records the update's change in
        the slot's delta buffer, which goes back to the host master."""
        deltas = self.streamer.delta_views(i)
        states = self.streamer.state_views(i) if self.optimizer.slots and self._state_needed(i) else {}
        return [Target(p, views[p.name], delta=None if deltas is None else deltas[p.name],
                       state=states.get(p.name, ())) for p in self.block_params[i]]

    def synchronize(self) -> None:
        self.streamer.synchronize()

    # --- the optimizer's state: the outer stage's on the device, the blocks' beside their host masters

    def _block_state(self) -> dict[str, torch.Tensor]:
        """Views of the blocks' host state by `<slot>/<parameter>` (current after a flush)."""
        out = {}
        for block, params in zip(self.host_blocks, self.block_params):
            trained = {p.name for p in params}
            for slot, flat in zip(self.optimizer.slots, block.state):
                out.update({state_key(slot, name): v for name, v in block.views(flat).items() if name in trained})
        return out

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        return {**self.state.export(), **self._block_state()}

    def load_optimizer_state(self, tensors) -> None:
        self.state.load(tensors)
        node = self._shared_node()
        if node is None or node.local_rank == 0:
            with torch.no_grad():
                for key, view in self._block_state().items():
                    view.copy_(tensors[key])
        if node is not None and self.optimizer.slots:
            node.barrier()
        self.streamer.forget_state()

    def state_resident_bytes(self) -> int:
        host = sum(t.numel() * t.element_size() for b in self.host_blocks for t in b.state)
        return self.state.nbytes() + host  # a private copy, every page written (zeroed)

    # --- telemetry and the rest ---------------------------------------------------------------------

    def describe(self) -> str:
        dtype = self.streamer.transfer.transfer_dtype
        return "blocks offloaded to host memory" + (f", moved in {str(dtype).replace('torch.', '')}" if dtype else "")

    def close(self) -> None:
        self.streamer.close()

    def stock_forward(self, force: bool = False):
        """The stock model's forward on the compute device, its blocks streamed through the slot ring
        (`streamed_stock_forward`); on a CPU the host masters are the forward's own parameters and
        nothing is done (force: stream anyway, which the tests use to check the swapping)."""
        if self.device.type == "cpu" and not force:
            return nullcontext()
        return streamed_stock_forward(self.adapter, self.streamer)

    def host_master_bytes(self) -> dict[str, int]:
        copy = sum(b.numel * b.flat.element_size() for b in self.host_blocks)
        return {"copy": copy, "resident": copy, "node_shared": False}  # a private copy, every page written

    def transfer_stats(self) -> dict[str, float]:
        return self.streamer.stats()


class SlicedOffloadStore(OffloadStore):
    """DistZO2's sliced communication: one node-shared host master; each rank uploads, updates and
    writes back its slice of every block and all-gathers the rest from its peers (the module
    docstring). Blocks arrive through collectives, so every rank walks every block every step."""

    walks_with_peers = True

    def __init__(self, model, adapter, params, optimizer, device, *, node: Node, **kwargs):
        self.node = node
        super().__init__(model, adapter, params, optimizer, device, **kwargs)

    def _shared_node(self) -> Node | None:
        return self.node

    def _build_streamer(self, slots: int, transfer_dtype: torch.dtype | None) -> SlicedBlockStreamer:
        return SlicedBlockStreamer(self.host_blocks, self.device, slots, transfer_dtype, self.node,
                                   awaits=self._awaits, update=self._update_slice)

    def describe(self) -> str:
        return super().describe() + f", one node-shared master sliced over {self.node.size} ranks"

    @contextmanager
    def block(self, i: int) -> Iterator[Block]:
        """Block i whole in its slot: my slice uploaded and updated (`_update_slice`), the rest gathered."""
        with self.loop.timers("transfer"):
            self.streamer.prefetch_from(i)  # next blocks' slices overlap this compute
            views = self.streamer.acquire(i)
        try:
            yield Block(views, self._targets(i, views))
        finally:
            self.streamer.release(i, write_back=False)  # my slice went back in `prefetch`

    def _update_slice(self, i: int, slot: torch.Tensor, lo: int, hi: int, delta: torch.Tensor | None) -> None:
        """The pending update on this rank's slice of block i: elements [lo, hi) of the block in its
        slot (and in the slot's delta buffer at reduced precision). The streamer calls it between the
        slice's upload and its write-back."""
        block = self.host_blocks[i]
        views = block.views(slot)
        deltas = block.views(delta) if delta is not None else {}
        states = self.streamer.state_views(i) if self.optimizer.slots else {}
        targets = []
        for p in self.block_params[i]:
            start = block.offsets[block.names.index(p.name)]
            a, b = max(lo, start) - start, min(hi, start + p.numel()) - start
            if a < b:
                targets.append(Target(p, views[p.name], (a, b), deltas.get(p.name), states.get(p.name, ())))
        self.loop.update_stage(i, targets)

    def flush_block(self, i: int) -> None:
        self.streamer.flush_slice(i)

    def after_flush(self) -> None:
        self.node.barrier()  # every slice of the shared master is current before anyone reads it

    def local_reads(self):
        """Evaluation: read whole blocks from the (flushed) master, with no collective."""
        return self.streamer.local_reads()

    def host_master_bytes(self) -> dict[str, int]:
        copy = sum(b.numel * b.flat.element_size() for b in self.host_blocks)
        # the proportional share of the shared mapping actually resident
        return {"copy": copy, "resident": mapped_resident_bytes(self.host_blocks[0].flat)["pss"], "node_shared": True}

    def state_resident_bytes(self) -> int:
        return self.state.nbytes() + sum(mapped_resident_bytes(t)["pss"] for t in self.host_blocks[0].state)


def offload_engine(model, adapter, params, directions, *, slots: int = 3, transfer_dtype: torch.dtype | None = None,
                   optimizer: Optimizer | None = None, **kwargs) -> StageLoop:
    """Blocks in host memory, streamed whole through a device slot ring."""
    optimizer = optimizer or SGD()
    store = OffloadStore(model, adapter, params, optimizer, directions.device, slots=slots,
                         transfer_dtype=transfer_dtype)
    return StageLoop(model, adapter, params, directions, store, optimizer=optimizer, mode="offload", **kwargs)


def sliced_offload_engine(model, adapter, params, directions, *, node: Node, slots: int = 3,
                          transfer_dtype: torch.dtype | None = None, optimizer: Optimizer | None = None,
                          **kwargs) -> StageLoop:
    """One node-shared host master; each rank moves a slice of every block (DistZO2)."""
    optimizer = optimizer or SGD()
    store = SlicedOffloadStore(model, adapter, params, optimizer, directions.device, node=node, slots=slots,
                               transfer_dtype=transfer_dtype)
    return StageLoop(model, adapter, params, directions, store, optimizer=optimizer, mode="offload-sliced", **kwargs)


@register("engine_mode", "offload")
class OffloadMode(EngineMode):
    """offload=cpu with every weight trainable: whole blocks per rank (one rank per node, or
    comm.sliced=false), or, as `offload-sliced`, one node-shared host master of which each rank moves
    a slice (several ranks per node, comm.sliced). An optimizer whose state shapes the directions
    (HiZOO) runs whole blocks: every rank's copies need the state of the whole block, and a sliced
    rank holds its slice's."""

    precedence, sliced = 30, False

    @classmethod
    def applies(cls, s: EngineSetup) -> bool:
        shaped = s.optimizer is not None and s.optimizer.shapes_directions
        return s.offload.mode == "cpu" and s.peft_method == "none" and (
            not cls.sliced or (s.node_shared and not shaped))

    @classmethod
    def build(cls, s: EngineSetup) -> StageLoop:
        dtype = getattr(torch, str(s.offload.transfer_dtype)) if s.offload.transfer_dtype else None
        if cls.sliced:
            return sliced_offload_engine(s.model, s.adapter, s.params, s.directions, node=s.mesh.node,
                                         slots=s.offload.slots, transfer_dtype=dtype, **s.loop_options())
        return offload_engine(s.model, s.adapter, s.params, s.directions, slots=s.offload.slots,
                              transfer_dtype=dtype, **s.loop_options())


@register("engine_mode", "offload-sliced")
class SlicedOffloadMode(OffloadMode):
    precedence, sliced = 31, True
