"""Host masters and the device slot ring of offloaded blocks (docs/offload.md).

`build_host_blocks` moves every block's parameters into flat host buffers (the master copy; one
node-shared buffer when sliced), `place_resident` puts everything else on the device, and
`BlockStreamer` moves blocks (or a rank's slice of them) between the host masters and a ring of
device slots, on their own CUDA streams ordered by events.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..models.adapters import DecoderAdapter
from ..parallel.node import Node

SLICE_ALIGN = 256  # elements: every slice starts on a 1 KiB (fp32) boundary, friendly to DMA engines


@dataclass
class HostBlock:
    """One block's parameters laid end to end in a flat host buffer (the master copy).

    `padded` is `flat` plus tail padding to `parts * slice_len` elements; slice j of the block is
    padded[j * slice_len:(j + 1) * slice_len] (parts = 1 when not sliced)."""

    prefix: str
    names: list[str]
    shapes: list[torch.Size]
    offsets: list[int]
    flat: torch.Tensor
    padded: torch.Tensor
    slice_len: int
    parts: int

    @property
    def numel(self) -> int:
        return self.flat.numel()

    def slice_range(self, j: int) -> tuple[int, int]:
        """Elements [lo, hi) of the block (not of the padding) that slice j holds."""
        lo = min(j * self.slice_len, self.numel)
        return lo, min(lo + self.slice_len, self.numel)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """This block's parameters as views of any flat buffer with the same layout."""
        return {n: flat[o:o + s.numel()].view(s) for n, s, o in zip(self.names, self.shapes, self.offsets)}


def _pin(tensor: torch.Tensor) -> None:
    """Page-lock a host tensor's memory in place (cudaHostRegister) so uploads from it are DMA."""
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed ({err}); the host master cannot be pinned")
    PINNED.append(tensor)


PINNED: list[torch.Tensor] = []  # host buffers registered by _pin, unregistered by unpin_all


def unpin_all() -> None:
    """Unregister every buffer `_pin` registered (before its memory can be freed)."""
    while PINNED:
        t = PINNED.pop()
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host buffer of exactly `numel` elements, page-locked when `pin`. Not torch's pinned
    allocator (`pin_memory=True`): its caching host allocator rounds every request up to a power of
    two, +33% for a 7B model's block and +60% for an OPT-13B block, memory the host master pays for
    and nothing reported. An ordinary allocation registered in place costs its size and no more."""
    t = torch.empty(numel, dtype=dtype)
    if pin:
        _pin(t)
    return t


def build_host_blocks(adapter: DecoderAdapter, pin_memory: bool, node: Node | None = None) -> list[HostBlock]:
    """Move every block's parameters into a flat host buffer per block. The Parameter objects stay
    the same (only `.data` is re-pointed), so anything holding them keeps working.

    node: lay the blocks out in one buffer shared by the node's ranks, each block padded into
    node.size aligned slices. Local rank 0 fills it; every rank holds the same weights (I1)."""
    parts = node.size if node is not None else 1
    layout = []
    for prefix, module in adapter.blocks:
        named = list(module.named_parameters())
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1:
            raise ValueError(f"block {prefix} mixes parameter dtypes {dtypes}; offloading needs one dtype per block")
        numel = sum(p.numel() for _, p in named)
        slice_len = math.ceil(math.ceil(numel / parts) / SLICE_ALIGN) * SLICE_ALIGN if parts > 1 else numel
        layout.append((prefix, named, dtypes.pop(), numel, slice_len))
    shared = None
    if node is not None:
        dtypes = {dtype for _, _, dtype, _, _ in layout}
        if len(dtypes) != 1:
            raise ValueError(f"blocks of several dtypes {dtypes}; the node-shared master needs one")
        shared = node.shared_tensor(sum(parts * s for *_, s in layout), dtypes.pop(), "master")
        if pin_memory:
            _pin(shared)
    blocks, start = [], 0
    for prefix, named, dtype, numel, slice_len in layout:
        if shared is not None:
            padded = shared[start:start + parts * slice_len]
            start += parts * slice_len
        else:
            padded = host_buffer(numel, dtype, pin_memory)
        flat = padded[:numel]
        names, shapes, offsets, offset = [], [], [], 0
        for rel, p in named:
            view = flat[offset:offset + p.numel()].view(p.shape)
            if node is None or node.local_rank == 0:
                view.copy_(p.data)
            # Re-pointed at once, so the private copy is freed parameter by parameter and no rank
            # holds the whole model twice. Nothing reads the weights before the barrier below.
            p.data = view
            names.append(f"{prefix}.{rel}")
            shapes.append(p.shape)
            offsets.append(offset)
            offset += p.numel()
        blocks.append(HostBlock(prefix, names, shapes, offsets, flat, padded, slice_len, parts))
    if node is not None:
        node.barrier()  # local rank 0 has filled the master
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


# (block index, the slot's flat buffer, [lo, hi) of the block, float32 delta buffer or None) -> updated?
SliceUpdate = Callable[[int, torch.Tensor, int, int, "torch.Tensor | None"], bool]


class BlockStreamer:
    """Moves blocks between the host masters and a ring of device slots.

    prefetch(i) starts block i's upload; acquire(i) makes the compute stream wait for it and
    returns the slot; release(i, write_back) returns the slot to the ring, first copying the
    block (or, at reduced precision, its update delta) back to the host master.

    Sliced (a node of n ranks): prefetch(i) uploads this rank's slice, lets `slice_update` apply
    the deferred update to it, writes the slice back, and all-gathers the other slices from the
    node's peers; `local=True` (probe) uploads the whole block instead, with no collective,
    since ranks evaluate different numbers of batches."""

    def __init__(self, blocks: Sequence[HostBlock], device: torch.device, slots: int,
                 transfer_dtype: torch.dtype | None, node: Node | None = None):
        self.blocks, self.device = blocks, device
        self.cuda = device.type == "cuda"
        self.node = node if node is not None and node.shared else None
        self.part = node.local_rank if self.node is not None else 0
        dtype = blocks[0].flat.dtype
        size = max(b.padded.numel() for b in blocks)
        self.transfer_dtype = transfer_dtype if transfer_dtype not in (None, dtype) else None
        n = min(slots, len(blocks))
        self.slots = [torch.empty(size, dtype=dtype, device=device) for _ in range(n)]
        self.owner: list[int | None] = [None] * n  # block whose current weights fill the slot
        if self.transfer_dtype is not None:
            pin = self.cuda
            self.host_stage = [host_buffer(size, self.transfer_dtype, pin) for _ in range(n)]  # uploads
            self.host_delta = [host_buffer(size, self.transfer_dtype, pin) for _ in range(n)]  # deltas back
            self.device_stage = [torch.empty(size, dtype=self.transfer_dtype, device=device) for _ in range(n)]
            self.deltas = [torch.zeros(size, dtype=torch.float32, device=device) for _ in range(n)]
        # Reduced-precision transfer on CUDA: the host's work runs on two worker threads, so the
        # Python thread queues the next blocks' kernels meanwhile instead of waiting for each
        # write-back. One narrows blocks for upload, the other adds returned deltas to the masters;
        # a block's narrowing waits only for its own last delta, and a delta buffer is reused only
        # after the add that read it.
        self._host: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        self._host_jobs: list[Future] = []
        self._uploading: dict[int, Future] = {}  # slot -> its upload job (records `uploaded[slot]`)
        self._adding: dict[int, Future] = {}  # block -> the add of its last delta
        self._delta_read: dict[int, Future] = {}  # slot -> the last add that read host_delta[slot]
        self._stage_read: list[torch.cuda.Event | None] = [None] * n  # last upload that read host_stage[s]
        if self.cuda and self.transfer_dtype is not None:
            self._host = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="distzo-narrow"),
                          ThreadPoolExecutor(max_workers=1, thread_name_prefix="distzo-delta"))
        if self.cuda:
            self.upload_stream = torch.cuda.Stream(device)
            self.offload_stream = torch.cuda.Stream(device)
            self.uploaded = [torch.cuda.Event() for _ in range(n)]
            self.slot_free: list[torch.cuda.Event | None] = [None] * n
            self.written: dict[int, torch.cuda.Event] = {}  # block -> its last write-back
            self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.slice_update: SliceUpdate | None = None
        self.slice_owed: Callable[[int], bool] = lambda i: False  # block i's slice still owes an update
        self.bytes_up = self.bytes_down = self.bytes_peer = 0
        self.transfer_s = 0.0

    @property
    def sliced(self) -> bool:
        return self.node is not None

    def slot_of(self, i: int) -> int:
        return i % len(self.slots)

    # --- timing ----------------------------------------------------------------------------------------

    @contextmanager
    def _timed_transfer(self) -> Iterator[None]:
        """Wall time of host-side copies (CPU), or device time between events (CUDA, resolved lazily)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._timed.append((start, end))
            return
        t0 = time.perf_counter()
        yield
        self.transfer_s += time.perf_counter() - t0

    def transfer_seconds(self) -> float:
        self._drain_host()  # uploads the host worker queued have recorded their timing events
        if self.cuda and self._timed:
            for start, end in self._timed:
                end.synchronize()
                self.transfer_s += start.elapsed_time(end) / 1e3
            self._timed.clear()
        return self.transfer_s

    # --- moving a range of a block ------------------------------------------------------------------

    def _upload(self, block: HostBlock, s: int, lo: int, hi: int) -> None:
        with self._timed_transfer():
            if self.transfer_dtype is None:
                self.slots[s][lo:hi].copy_(block.flat[lo:hi], non_blocking=True)
                self.bytes_up += (hi - lo) * block.flat.element_size()
            else:
                if self._stage_read[s] is not None:
                    # The previous upload from this staging buffer may still be queued: overwriting
                    # it now would send the wrong block (the host runs ahead of the GPU).
                    self._stage_read[s].synchronize()
                self.host_stage[s][lo:hi].copy_(block.flat[lo:hi])  # narrow on the host (CPU work)
                self.device_stage[s][lo:hi].copy_(self.host_stage[s][lo:hi], non_blocking=True)
                if self.cuda:
                    self._stage_read[s] = torch.cuda.Event()
                    self._stage_read[s].record()
                self.slots[s][lo:hi].copy_(self.device_stage[s][lo:hi])  # widen on the device
                self.bytes_up += (hi - lo) * self.host_stage[s].element_size()

    def _write_back(self, block: HostBlock, s: int, lo: int, hi: int) -> None:
        with self._timed_transfer():
            if self.transfer_dtype is None:
                block.flat[lo:hi].copy_(self.slots[s][lo:hi], non_blocking=True)
                self.bytes_down += (hi - lo) * block.flat.element_size()
                return
            reading = self._delta_read.pop(s, None)
            if reading is not None:
                reading.result()  # the add that reads this delta buffer is done with it
            self.device_stage[s][lo:hi].copy_(self.deltas[s][lo:hi])  # narrow the delta on the device
            self.host_delta[s][lo:hi].copy_(self.device_stage[s][lo:hi], non_blocking=True)
            self.bytes_down += (hi - lo) * self.host_delta[s].element_size()
        if not self.cuda:
            self._add_delta(block, s, lo, hi)

    def _add_delta(self, block: HostBlock, s: int, lo: int, hi: int) -> None:
        # Mixed-dtype in place: widened element by element, with no block-sized temporary.
        block.flat[lo:hi].add_(self.host_delta[s][lo:hi])

    def _add_delta_when(self, done: torch.cuda.Event, i: int, s: int, lo: int, hi: int) -> None:
        """Add block i's delta once its copy to the host (`done`) has landed, on the delta worker."""
        block = self.blocks[i]

        def job() -> None:
            done.synchronize()
            self._add_delta(block, s, lo, hi)
        future = self._host[1].submit(job)
        self._host_jobs.append(future)
        self._adding[i] = self._delta_read[s] = future

    def _drain_host(self) -> None:
        """Wait for the host workers' jobs (re-raising their errors): host masters and staging
        buffers are then the Python thread's to read and write. Without workers there are none."""
        jobs, self._host_jobs, self._uploading, self._adding, self._delta_read = self._host_jobs, [], {}, {}, {}
        errors = [job.exception() for job in jobs]  # waits for every job, failed or not
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            raise failed

    def _gather(self, block: HostBlock, s: int) -> None:
        """Every peer's slice of the block into this slot (this rank's slice is already there)."""
        padded = self.slots[s][:block.padded.numel()]
        parts = list(padded.split(block.slice_len))
        with self._timed_transfer():
            if self.cuda:  # NCCL gathers in place into one buffer
                dist.all_gather_into_tensor(padded, parts[self.part], group=self.node.device_group)
            else:  # gloo takes a list of outputs; the input must not alias one of them
                dist.all_gather(parts, parts[self.part].clone(), group=self.node.device_group)
        self.bytes_peer += (block.parts - 1) * block.slice_len * block.flat.element_size()

    # --- the ring --------------------------------------------------------------------------------------

    def prefetch(self, i: int, local: bool = False) -> None:
        if self.sliced and not local:
            self._prefetch_sliced(i)
            return
        s = self.slot_of(i)
        if self.owner[s] == i:
            return
        self.owner[s] = i
        block = self.blocks[i]
        if not self.cuda:
            self._upload(block, s, 0, block.numel)
            return
        if self._host is not None:  # narrowing on the host worker, after this block's last delta
            slot_free, written, adding = self.slot_free[s], self.written.get(i), self._adding.get(i)
            job = self._host[0].submit(self._queue_upload, block, s, slot_free, written, adding)
            self._host_jobs.append(job)
            self._uploading[s] = job
            return
        self._queue_upload(block, s, self.slot_free[s], self.written.get(i))

    def _queue_upload(self, block: HostBlock, s: int, slot_free, written, adding: Future | None = None) -> None:
        if adding is not None:
            adding.result()  # the block's master holds its last delta
        with torch.cuda.device(self.device), torch.cuda.stream(self.upload_stream):
            self._wait_for_slot(slot_free, written)
            self._upload(block, s, 0, block.numel)
            self.uploaded[s].record(self.upload_stream)

    def _wait_for_slot(self, slot_free: torch.cuda.Event | None, written: torch.cuda.Event | None) -> None:
        """The upload stream waits for the slot's previous block (`slot_free[s]`) and for the block's
        last write-back (`written[i]`), taken when the upload was queued."""
        if slot_free is not None:
            self.upload_stream.wait_event(slot_free)  # the slot's previous block is done
        if written is not None:
            self.upload_stream.wait_event(written)  # the host master is current

    def _prefetch_sliced(self, i: int) -> None:
        """My slice up, its deferred update, my slice back, the peers' slices in."""
        s, block = self.slot_of(i), self.blocks[i]
        lo, hi = block.slice_range(self.part)
        current = self.owner[s] == i
        if current and not self.slice_owed(i):
            # Prefetched already (acquire follows the prefetches of the next blocks): recording the
            # upload event again would make block i's compute wait for everything queued since.
            return

        def work() -> None:
            if not current:
                self._upload(block, s, lo, hi)
            delta = self.deltas[s] if self.transfer_dtype is not None else None
            updated = self.slice_update is not None and self.slice_update(i, self.slots[s], lo, hi, delta)
            if updated:
                self._write_back(block, s, lo, hi)
            if updated or not current:
                self._gather(block, s)

        self.owner[s] = i
        if not self.cuda:
            work()
            return
        self._drain_host()  # this thread narrows now: earlier deltas must be in the master
        with torch.cuda.stream(self.upload_stream):
            self._wait_for_slot(self.slot_free[s], self.written.get(i))
            written_before = self.bytes_down
            work()
            if self.bytes_down != written_before:
                done = torch.cuda.Event()
                done.record(self.upload_stream)
                self.written[i] = done
                if self.transfer_dtype is not None:
                    self._add_delta_when(done, i, s, lo, hi)
            self.uploaded[s].record(self.upload_stream)

    def flush_slice(self, i: int) -> None:
        """Sliced: bring my slice of block i's host master up to date (no collective)."""
        s, block = self.slot_of(i), self.blocks[i]
        lo, hi = block.slice_range(self.part)
        self.owner[s] = None  # the slot ends with only my slice current

        def work() -> bool:
            self._upload(block, s, lo, hi)
            delta = self.deltas[s] if self.transfer_dtype is not None else None
            updated = self.slice_update is not None and self.slice_update(i, self.slots[s], lo, hi, delta)
            if updated:
                self._write_back(block, s, lo, hi)
            return updated

        if not self.cuda:
            work()
            return
        self._drain_host()
        with torch.cuda.stream(self.upload_stream):
            self._wait_for_slot(self.slot_free[s], self.written.get(i))
            if work():
                done = torch.cuda.Event()
                done.record(self.upload_stream)
                self.written[i] = self.slot_free[s] = done
                if self.transfer_dtype is not None:
                    self._add_delta_when(done, i, s, lo, hi)

    def acquire(self, i: int, local: bool = False) -> dict[str, torch.Tensor]:
        self.prefetch(i, local)
        s = self.slot_of(i)
        job = self._uploading.pop(s, None)
        if job is not None:
            job.result()  # the worker has queued the upload and recorded its event
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

    def release(self, i: int, write_back: bool, updated: bool = False) -> None:
        """Done computing with block i. write_back: copy it (or its delta) to the host master.
        updated: its update reached the master some other way (sliced) and the slot differs from it."""
        s, block = self.slot_of(i), self.blocks[i]
        if (write_back or updated) and self.transfer_dtype is not None:
            # The slot holds the update at full precision, the host master its narrowed delta: the
            # next use must upload again to see exactly what every other path sees.
            self.owner[s] = None
        if not self.cuda:
            if write_back:
                self._write_back(block, s, 0, block.numel)
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
            self._write_back(block, s, 0, block.numel)
            done = torch.cuda.Event()
            done.record(self.offload_stream)
        self.slot_free[s] = self.written[i] = done
        if self.transfer_dtype is not None:
            self._add_delta_when(done, i, s, 0, block.numel)

    def synchronize(self) -> None:
        """Wait for every write-back: the host masters are then safe to read."""
        self._drain_host()
        if self.cuda:
            self.offload_stream.synchronize()
            self.upload_stream.synchronize()

    def close(self) -> None:
        if self._host is None:
            return
        try:
            self._drain_host()
        finally:
            for pool in self._host:
                pool.shutdown(wait=True)
            self._host = None
