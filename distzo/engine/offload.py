"""ZO2-style offloading: decoder blocks live in host memory and stream through the compute device.

Embeddings, final norm and LM head stay on the device. Each block's parameters are re-pointed
into one flat host buffer (pinned on CUDA), the master copy. Every step, each block is uploaded
once into a slot of a small ring of preallocated device buffers, receives the previous step's
deferred update, serves all of the rank's evaluations, and, if it was updated, goes back to the
host master. On CUDA, uploads and write-backs run on their own streams and are ordered against the
compute stream with events (ZO2's Algorithm 2), so block i+1 uploads and block i-1 writes back
while block i computes. On CPU the same code runs with host-to-host copies.

The deferred update is the same chunked function as the resident engine's (fused with the block's
perturbation), applied to the uploaded copy, so offloaded and resident training agree bitwise. With `transfer_dtype` (bf16/fp16) a block travels
at reduced precision and is widened on the device; the host keeps the full-precision master and
receives the update as a reduced-precision delta (4 bytes a parameter per step instead of 8 for a
full-precision round trip, and no update is lost to rounding the master).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import torch
from torch import nn

from ..models.adapters import DecoderAdapter
from ..zo.directions import Directions
from ..zo.params import TrainableParams
from .base import StagedEngine
from .update import apply_update


@dataclass
class HostBlock:
    """One block's parameters laid end to end in a flat host buffer (the master copy)."""

    prefix: str
    names: list[str]
    shapes: list[torch.Size]
    offsets: list[int]
    flat: torch.Tensor

    @property
    def numel(self) -> int:
        return self.flat.numel()

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """This block's parameters as views of any flat buffer with the same layout."""
        return {n: flat[o:o + s.numel()].view(s) for n, s, o in zip(self.names, self.shapes, self.offsets)}


def build_host_blocks(adapter: DecoderAdapter, pin_memory: bool) -> list[HostBlock]:
    """Move every block's parameters into one flat host buffer per block. The Parameter objects
    stay the same (only `.data` is re-pointed), so anything holding them keeps working."""
    blocks = []
    for prefix, module in adapter.blocks:
        named = list(module.named_parameters())
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1:
            raise ValueError(f"block {prefix} mixes parameter dtypes {dtypes}; offloading needs one dtype per block")
        total = sum(p.numel() for _, p in named)
        flat = torch.empty(total, dtype=dtypes.pop(), pin_memory=pin_memory)
        names, shapes, offsets, offset = [], [], [], 0
        for rel, p in named:
            view = flat[offset:offset + p.numel()].view(p.shape)
            view.copy_(p.data)
            p.data = view
            names.append(f"{prefix}.{rel}")
            shapes.append(p.shape)
            offsets.append(offset)
            offset += p.numel()
        blocks.append(HostBlock(prefix, names, shapes, offsets, flat))
    return blocks


def place_resident(model: nn.Module, device: torch.device, host_blocks: Sequence[HostBlock]) -> None:
    """Everything except the offloaded block parameters goes to the compute device."""
    offloaded = {n for b in host_blocks for n in b.names}
    for name, p in model.named_parameters():
        if name not in offloaded:
            p.data = p.data.to(device)
    for module in model.modules():
        for key, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[key] = buf.to(device)


class BlockStreamer:
    """Moves blocks between the host masters and a ring of device slots.

    prefetch(i) starts block i's upload; acquire(i) makes the compute stream wait for it and
    returns the slot; release(i, write_back) returns the slot to the ring, first copying the
    block (or, at reduced precision, its update delta) back to the host master."""

    def __init__(self, blocks: Sequence[HostBlock], device: torch.device, slots: int,
                 transfer_dtype: torch.dtype | None):
        self.blocks, self.device = blocks, device
        self.cuda = device.type == "cuda"
        dtype = blocks[0].flat.dtype
        size = max(b.numel for b in blocks)
        self.transfer_dtype = transfer_dtype if transfer_dtype not in (None, dtype) else None
        n = min(slots, len(blocks))
        self.slots = [torch.empty(size, dtype=dtype, device=device) for _ in range(n)]
        self.owner: list[int | None] = [None] * n
        if self.transfer_dtype is not None:
            pin = self.cuda
            self.host_stage = [torch.empty(size, dtype=self.transfer_dtype, pin_memory=pin) for _ in range(n)]
            self.device_stage = [torch.empty(size, dtype=self.transfer_dtype, device=device) for _ in range(n)]
            self.deltas = [torch.zeros(size, dtype=torch.float32, device=device) for _ in range(n)]
        if self.cuda:
            self.upload_stream = torch.cuda.Stream(device)
            self.offload_stream = torch.cuda.Stream(device)
            self.uploaded = [torch.cuda.Event() for _ in range(n)]
            self.slot_free: list[torch.cuda.Event | None] = [None] * n
            self.written: dict[int, torch.cuda.Event] = {}  # block -> its last write-back
        self.bytes_up = self.bytes_down = 0

    def slot_of(self, i: int) -> int:
        return i % len(self.slots)

    def prefetch(self, i: int) -> None:
        s = self.slot_of(i)
        if self.owner[s] == i:
            return
        self.owner[s] = i
        block = self.blocks[i]
        n = block.numel
        if self.transfer_dtype is not None:
            self.host_stage[s][:n].copy_(block.flat)  # narrow on the host (CPU work)
        if not self.cuda:
            self._upload(block, s, n)
            return
        with torch.cuda.stream(self.upload_stream):
            if self.slot_free[s] is not None:
                self.upload_stream.wait_event(self.slot_free[s])  # the slot's previous block is done
            if i in self.written:
                self.upload_stream.wait_event(self.written[i])  # the host master is current
            self._upload(block, s, n)
            self.uploaded[s].record(self.upload_stream)

    def _upload(self, block: HostBlock, s: int, n: int) -> None:
        if self.transfer_dtype is None:
            self.slots[s][:n].copy_(block.flat, non_blocking=True)
            self.bytes_up += n * block.flat.element_size()
        else:
            self.device_stage[s][:n].copy_(self.host_stage[s][:n], non_blocking=True)
            self.slots[s][:n].copy_(self.device_stage[s][:n])  # widen on the device
            self.bytes_up += n * self.host_stage[s].element_size()

    def acquire(self, i: int) -> dict[str, torch.Tensor]:
        self.prefetch(i)
        s = self.slot_of(i)
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(self.uploaded[s])
            if self.slot_free[s] is not None:  # a block kept in its slot: its last write-back has read it
                compute.wait_event(self.slot_free[s])
        return self.blocks[i].views(self.slots[s])

    def delta_views(self, i: int) -> dict[str, torch.Tensor] | None:
        if self.transfer_dtype is None:
            return None
        return self.blocks[i].views(self.deltas[self.slot_of(i)])

    def release(self, i: int, write_back: bool) -> None:
        s, block = self.slot_of(i), self.blocks[i]
        n = block.numel
        if write_back and self.transfer_dtype is not None:
            # The slot holds the update at full precision, the host master its narrowed delta: the
            # next use must upload again to see exactly what every other path sees.
            self.owner[s] = None
        if not self.cuda:
            if write_back:
                self._write_back(block, s, n)
            return
        if not write_back:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.slot_free[s] = ev
            return
        computed = torch.cuda.Event()
        computed.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.offload_stream):
            self.offload_stream.wait_event(computed)
            self._write_back(block, s, n)
            done = torch.cuda.Event()
            done.record(self.offload_stream)
        self.slot_free[s] = self.written[i] = done
        if self.transfer_dtype is not None:
            done.synchronize()  # the host adds the delta below, so it must have arrived
            block.flat.add_(self.host_stage[s][:n].to(block.flat.dtype))

    def _write_back(self, block: HostBlock, s: int, n: int) -> None:
        if self.transfer_dtype is None:
            block.flat.copy_(self.slots[s][:n], non_blocking=True)
            self.bytes_down += n * block.flat.element_size()
            return
        self.device_stage[s][:n].copy_(self.deltas[s][:n])  # narrow the delta on the device
        self.host_stage[s][:n].copy_(self.device_stage[s][:n], non_blocking=True)
        self.bytes_down += n * self.host_stage[s].element_size()
        if not self.cuda:
            block.flat.add_(self.host_stage[s][:n].to(block.flat.dtype))

    def synchronize(self) -> None:
        """Wait for every write-back: the host masters are then safe to read."""
        if self.cuda:
            self.offload_stream.synchronize()
            self.upload_stream.synchronize()


class OffloadEngine(StagedEngine):
    def __init__(self, model: nn.Module, adapter: DecoderAdapter, params: TrainableParams, directions: Directions,
                 slots: int = 3, transfer_dtype: torch.dtype | None = None, row_tokens: int = 1024):
        device = directions.device
        self.host_blocks = build_host_blocks(adapter, pin_memory=device.type == "cuda")
        place_resident(model, device, self.host_blocks)
        super().__init__(model, adapter, params, directions, row_tokens)
        self.streamer = BlockStreamer(self.host_blocks, device, slots, transfer_dtype)

    @contextmanager
    def block_sources(self, i: int) -> Iterator[Mapping[str, torch.Tensor]]:
        """Upload block i (prefetching the next ones), let it compute, write it back if the deferred
        update changed it."""
        updated = self.owes(i)
        with self.timers("transfer"):
            for j in range(i, min(i + len(self.streamer.slots), len(self.host_blocks))):
                self.streamer.prefetch(j)  # uploads of the next blocks overlap this block's compute
            views = self.streamer.acquire(i)
        if updated and self.streamer.transfer_dtype is not None:
            # Reduced-precision transfer: apply the update here, recording the deltas to send back.
            with self.timers("update"):
                u = self.take_pending(i)
                deltas = self.streamer.delta_views(i)
                targets = [(p, views[p.name]) for p in self.block_params[i]]
                apply_update(self.directions, targets, u, deltas=[deltas[p.name] for p, _ in targets])
        try:
            yield views
        finally:
            with self.timers("transfer"):
                self.streamer.release(i, write_back=updated)

    def after_flush(self) -> None:
        self.streamer.synchronize()

    def transfer_stats(self) -> dict[str, int]:
        return {"h2d_bytes": self.streamer.bytes_up, "d2h_bytes": self.streamer.bytes_down}
