"""ZO2-style offloading: decoder blocks live in host memory and stream through the compute device.

Embeddings, final norm and LM head stay on the device. Each block's parameters are re-pointed
into one flat host buffer (pinned on CUDA), the master copy. Every step, each block is uploaded
once into a slot of a small ring of preallocated device buffers, receives the previous step's
deferred update, serves all of the rank's probes, and, if it was updated, goes back to the
host master. On CUDA, uploads and write-backs run on their own streams and are ordered against the
compute stream with events (ZO2's Algorithm 2), so block i+1 uploads and block i-1 writes back
while block i computes. On CPU the same code runs with host-to-host copies.

The deferred update is paid by the resident engine's `_pay` (fused with the block's perturbation),
on the uploaded copy, so offloaded and resident training agree bitwise. With `transfer_dtype`
(bf16/fp16) a block travels at reduced precision and is widened on the device; the host keeps the
full-precision master and receives the update as a reduced-precision delta (4 bytes a parameter per
step instead of 8 for a full-precision round trip, and no update is lost to rounding the master).

Sliced communication (DistZO2 §6.1, `comm.sliced=true` with several ranks on a node): the node
keeps ONE host master, in memory every local rank maps (`distzo.parallel.node`), laid out so that local
rank j owns slice j of every block (equal, aligned, contiguous ranges: DistZO2's thread-aligned
partitioning). For each block a rank uploads only its slice, applies the deferred update to that
slice alone (so the node's ranks share the update's noise regeneration), writes that slice back,
and all-gathers the other slices from its peers over the node group (NCCL, so NVLink, on GPUs;
gloo on CPU). Per block and step a rank moves 1/n of the block over the host link each way instead
of all of it; the rest crosses the peer links. Every element still receives exactly the
operations of the resident update, so the weights stay bitwise the same.

An optimizer with state keeps the blocks' state beside their host master (node-shared with it on
the sliced path) and streams it with the blocks that owe an update (`streamer`); the outer stage's
state stays on the device with the outer stage.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping

import torch
from torch import nn

from ..models.adapters import DecoderAdapter
from ..parallel.node import Node, mapped_resident_bytes
from ..zo.directions import Directions
from ..zo.optimizers import SGD
from ..zo.params import TrainableParams
from .base import EngineConfigError
from .optstate import StateBuffers, state_key
from .staged import StagedEngine
from .streamer import (
    BlockStreamer,
    SlicedBlockStreamer,
    build_host_blocks,
    place_resident,
    unpin_all,
)
from .update import Target


class OffloadEngine(StagedEngine):
    """Blocks in host memory (one master per rank), streamed whole through the device slot ring."""

    mode = "offload"

    def __init__(self, model: nn.Module, adapter: DecoderAdapter, params: TrainableParams, directions: Directions,
                 *, slots: int = 3, transfer_dtype: torch.dtype | None = None, **kwargs):
        device = directions.device
        state_slots = len((kwargs.get("optimizer") or SGD()).slots)
        self.host_blocks = build_host_blocks(adapter, pin_memory=device.type == "cuda", node=self._shared_node(),
                                             state_slots=state_slots)
        place_resident(model, device, self.host_blocks)
        super().__init__(model, adapter, params, directions, **kwargs)
        self.streamer = self._build_streamer(slots, transfer_dtype)

    def _shared_node(self) -> Node | None:
        """The node whose ranks share one host master (sliced), or None (a master of its own)."""
        return None

    def _build_streamer(self, slots: int, transfer_dtype: torch.dtype | None) -> BlockStreamer:
        return BlockStreamer(self.host_blocks, self.device, slots, transfer_dtype, owes=self.owes)

    # --- the optimizer's state: the outer stage's on the device, the blocks' beside their host masters

    def _build_state(self) -> StateBuffers:
        return StateBuffers(self.optimizer.slots, self.outer_params, self.device)

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

    def optimizer_state_bytes(self) -> dict[str, int]:
        host = sum(t.numel() * t.element_size() for b in self.host_blocks for t in b.state)
        copy = self.optimizer.state_bytes(self.params.numel())
        return {"copy": copy, "resident": self.state.nbytes() + self._host_state_resident(host)}

    def _host_state_resident(self, host: int) -> int:
        return host  # a private copy, every page written (zeroed)

    def describe(self) -> str:
        dtype = self.streamer.transfer.transfer_dtype
        return "blocks offloaded to host memory" + (f", moved in {str(dtype).replace('torch.', '')}" if dtype else "")

    @contextmanager
    def block_sources(self, i: int) -> Iterator[Mapping[str, torch.Tensor]]:
        """Upload block i (prefetching the next ones), let it compute, write it back if it owed an
        update (paid on the slot meanwhile: `_pay`)."""
        updated = self.owes(i)
        with self.timers("transfer"):
            for j in range(i, min(i + len(self.streamer.slots), len(self.host_blocks))):
                self.streamer.prefetch(j)  # uploads of the next blocks overlap this block's compute
            views = self.streamer.acquire(i)
        try:
            yield views
        finally:
            with self.timers("transfer"):
                self.streamer.release(i, write_back=updated)

    def _targets(self, i: int, sources) -> list[Target]:
        """Block i's masters in its slot; at reduced precision each records the update's change in
        the slot's delta buffer, which goes back to the host master."""
        deltas = self.streamer.delta_views(i)
        states = self.streamer.state_views(i) if self.optimizer.slots and self.owes(i) else {}
        return [Target(p, sources[p.name], delta=None if deltas is None else deltas[p.name],
                       state=states.get(p.name, ())) for p in self.block_params[i]]

    def _after_flush(self) -> None:
        self.streamer.synchronize()

    def _settle(self) -> None:
        self.streamer.synchronize()

    def close(self) -> None:
        try:
            self.streamer.close()  # its host workers, after the last delta reached the master
            if self.device.type == "cuda":
                self.streamer.synchronize()
        finally:
            if self.device.type == "cuda":
                unpin_all()  # page-locked host masters are unregistered before their memory can go
            super().close()

    def check_can_generate(self) -> None:
        if self.device.type != "cpu":
            raise EngineConfigError("generation tasks decode with the stock model on its own parameters, and "
                                    "offloaded blocks live in host memory; evaluate them with offload=none")

    def host_master_bytes(self) -> dict[str, int]:
        copy = sum(b.numel * b.flat.element_size() for b in self.host_blocks)
        return {"copy": copy, "resident": copy}  # a private copy, every page written

    def transfer_stats(self) -> dict[str, float]:
        m = self.streamer.meter
        return {"h2d_bytes": m.bytes_up, "d2h_bytes": m.bytes_down, "peer_bytes": m.bytes_peer,
                "transfer_s": self.streamer.transfer_seconds()}


class SlicedOffloadEngine(OffloadEngine):
    """DistZO2's sliced communication: one node-shared host master; each rank uploads, updates and
    writes back its slice of every block and all-gathers the rest from its peers (the module
    docstring). Blocks arrive through collectives, so every rank walks every block every step."""

    walks_with_peers = True
    mode = "offload-sliced"

    def __init__(self, model, adapter, params, directions, *, node: Node, **kwargs):
        self.node = node
        super().__init__(model, adapter, params, directions, **kwargs)

    def _shared_node(self) -> Node | None:
        return self.node

    def _build_streamer(self, slots: int, transfer_dtype: torch.dtype | None) -> SlicedBlockStreamer:
        return SlicedBlockStreamer(self.host_blocks, self.device, slots, transfer_dtype, self.node,
                                   owes=self.owes, pay=self._pay_slice)

    def describe(self) -> str:
        return super().describe() + f", one node-shared master sliced over {self.node.size} ranks"

    @contextmanager
    def block_sources(self, i: int) -> Iterator[Mapping[str, torch.Tensor]]:
        """Block i whole in its slot: my slice uploaded and paid (`_pay_slice`), the rest gathered."""
        with self.timers("transfer"):
            for j in range(i, min(i + len(self.streamer.slots), len(self.host_blocks))):
                self.streamer.prefetch(j)  # next blocks' slices overlap this compute
            views = self.streamer.acquire(i)
        try:
            yield views
        finally:
            self.streamer.release(i, write_back=False)  # my slice went back in `prefetch`

    def _pay_slice(self, i: int, slot: torch.Tensor, lo: int, hi: int, delta: torch.Tensor | None) -> None:
        """`_pay` on this rank's slice of block i: elements [lo, hi) of the block in its slot (and in
        the slot's delta buffer at reduced precision). The streamer calls it between the slice's
        upload and its write-back."""
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
        self._pay(i, targets)

    def _flush_block(self, i: int) -> None:
        self.streamer.flush_slice(i)

    def _after_flush(self) -> None:
        self.streamer.synchronize()
        self.node.barrier()  # every slice of the shared master is current before anyone reads it

    @contextmanager
    def _local_reads(self) -> Iterator[None]:
        """Evaluation: read whole blocks from the (flushed) master, with no collective."""
        with self.streamer.local_reads():
            yield

    def host_master_bytes(self) -> dict[str, int]:
        copy = sum(b.numel * b.flat.element_size() for b in self.host_blocks)
        # the proportional share of the shared mapping actually resident
        return {"copy": copy, "resident": mapped_resident_bytes(self.host_blocks[0].flat)["pss"]}

    def _host_state_resident(self, host: int) -> int:
        return sum(mapped_resident_bytes(t)["pss"] for t in self.host_blocks[0].state)  # this rank's share
