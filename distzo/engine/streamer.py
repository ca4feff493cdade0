"""Host masters and the device slot ring of offloaded blocks (docs/offload.md).

`build_host_blocks` moves every block's parameters into flat host buffers (the master copy; one
node-shared buffer when sliced) and `place_resident` puts everything else on the device. A
streamer then moves blocks between the host masters and a ring of device slots, on their own CUDA
streams ordered by events. Two choices compose:

- the streamer, which decides what moves when: `BlockStreamer` moves whole blocks;
  `SlicedBlockStreamer` moves this rank's slice of each block, has the engine apply the pending
  update to the slice, and all-gathers the other slices from the node's peers;
- the transfer, which moves a range of a block: `FullPrecisionTransfer` copies it as it is;
  `ReducedPrecisionTransfer` narrows it for the trip and returns an update as a narrowed delta
  (`CudaReducedPrecisionTransfer`: the host's share of that on worker threads).

An optimizer with state (momentum, adam) keeps each block's state beside its host master, in the
same layout (`HostBlock.state`, node-shared when the master is), and the streamer moves it with the
block: up into the slot's state buffers before a block that awaits an update receives it, back after it,
always at full precision (the state is exact whatever `transfer_dtype` does to the weights), on the
same streams and events as the block's own copies. A rank of the sliced path moves the state of its
slice only. Blocks that await nothing (evaluation) move no state.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..models.adapters import DecoderAdapter, parameter_slots
from ..models.mapped import MappedFiles
from ..parallel.node import Node

SLICE_ALIGN = 256  # elements: every slice starts on a 1 KiB (fp32) boundary, friendly to DMA engines


@dataclass
class HostBlock:
    """One block's parameters laid end to end in a flat host buffer (the master copy).

    `padded` is `flat` plus tail padding to `parts * slice_len` elements; slice j of the block is
    padded[j * slice_len:(j + 1) * slice_len] (parts = 1 when not sliced). `state`: the optimizer's
    state of the block, one float32 buffer per slot laid out like `flat` (none for sgd)."""

    prefix: str
    names: list[str]
    shapes: list[torch.Size]
    offsets: list[int]
    flat: torch.Tensor
    padded: torch.Tensor
    slice_len: int
    parts: int
    state: tuple[torch.Tensor, ...] = ()

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
    two, +33% for a 7B model's block and +60% for an OPT-13B block, memory the host master would hold
    and nothing reported. An ordinary allocation registered in place costs its size and no more."""
    t = torch.empty(numel, dtype=dtype)
    if pin:
        _pin(t)
    return t


def build_host_blocks(adapter: DecoderAdapter, pin_memory: bool, node: Node | None = None,
                      state_slots: int = 0, state_initial: float = 0.0) -> list[HostBlock]:
    """Move every block's parameters into a flat host buffer per block. The Parameter objects stay
    the same (only `.data` is re-pointed), so anything holding them keeps working.

    node: lay the blocks out in one buffer shared by the node's ranks, each block padded into
    node.size aligned slices. Local rank 0 fills it; every rank holds the same weights (I1).
    state_slots: float32 buffers of optimizer state per block, in the same layout (node-shared
    with the master), each element `state_initial` at the start (the optimizer's `initial`)."""
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
    mapped = MappedFiles()  # the checkpoint's pages, given back as each weight reaches its host master
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
                mapped.release(p.data)
            # Re-pointed at once, so the private copy is freed parameter by parameter and no rank
            # holds the whole model twice. Nothing reads the weights before the barrier below.
            p.data = view
            names.append(f"{prefix}.{rel}")
            shapes.append(p.shape)
            offsets.append(offset)
            offset += p.numel()
        blocks.append(HostBlock(prefix, names, shapes, offsets, flat, padded, slice_len, parts))
    if state_slots:
        _attach_state(blocks, state_slots, pin_memory, node, state_initial)
    if node is not None:
        node.barrier()  # local rank 0 has filled the master (and the state)
    return blocks


def _attach_state(blocks: list[HostBlock], slots: int, pin_memory: bool, node: Node | None,
                  initial: float = 0.0) -> None:
    """Each block's optimizer state: `slots` float32 buffers laid out like its padded master, in one
    node-shared buffer per slot when the master is node-shared, filled with `initial` by local rank 0."""
    total = sum(b.padded.numel() for b in blocks)
    per_slot = []
    for k in range(slots):
        if node is not None:
            buf = node.shared_tensor(total, torch.float32, f"optim-state{k}")
            if pin_memory:
                _pin(buf)
        else:
            buf = host_buffer(total, torch.float32, pin_memory)
        if node is None or node.local_rank == 0:
            buf.fill_(initial)
        per_slot.append(buf)
    start = 0
    for b in blocks:
        n = b.padded.numel()
        b.state = tuple(buf[start:start + n] for buf in per_slot)
        start += n


def place_resident(model: nn.Module, device: torch.device, streamed: Iterable[str]) -> None:
    """Everything except the parameters named in `streamed` (those kept in host memory) goes to the
    compute device."""
    streamed = set(streamed)
    for name, p in model.named_parameters():
        if name not in streamed:
            p.data = p.data.to(device)
    for module in model.modules():
        for key, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[key] = buf.to(device)
    if device.type == "cuda":
        # A model drawn on the device (model.init_device=device) left the streamed blocks' storage in
        # torch's caching allocator when they moved into host masters: return it to the device, or
        # the process keeps a resident model's memory reserved (and every peak counts it).
        torch.cuda.empty_cache()


# --- transfers: how a range of a block moves between its host master and a device slot ---------------


class TransferMeter:
    """Bytes moved and the time spent moving them: wall time of host-side copies (CPU), or device
    time between CUDA events around them, resolved when read (no synchronisation while streaming)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.bytes_up = self.bytes_down = self.bytes_peer = 0
        self._seconds = 0.0
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: not resolved yet

    @contextmanager
    def timed(self) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._timed.append((start, end))
            return
        t0 = time.perf_counter()
        yield
        self._seconds += time.perf_counter() - t0

    def seconds(self) -> float:
        """Seconds spent so far (waits for the recorded events: call it after the host workers' jobs)."""
        for start, end in self._timed:
            end.synchronize()
            self._seconds += start.elapsed_time(end) / 1e3
        self._timed.clear()
        return self._seconds


class Transfer(ABC):
    """Moves flat ranges [lo, hi) of blocks between their host masters and the device slots. On CUDA
    each copy is queued on the current stream; the streamer picks the stream and orders it with
    events. The hooks below the copies serve transfers with host worker threads; here they run
    everything at once."""

    transfer_dtype: torch.dtype | None = None  # what blocks travel in (None: the master's own dtype)
    exact = True  # a slot whose update was written back holds exactly what its host master holds

    def __init__(self, slots: Sequence[torch.Tensor], meter: TransferMeter):
        self.slots, self.meter = slots, meter

    @abstractmethod
    def upload(self, block: HostBlock, s: int, lo: int, hi: int) -> None:
        """Elements [lo, hi) of the block's master into slot s."""

    @abstractmethod
    def write_back(self, block: HostBlock, s: int, lo: int, hi: int) -> None:
        """The update of elements [lo, hi) in slot s back into the block's master."""

    def deltas(self, s: int) -> torch.Tensor | None:
        """Slot s's float32 buffer that receives an update's change (`Target.delta`), or None."""
        return None

    def queue_upload(self, i: int, s: int, queue: Callable[[], None]) -> None:
        """Run `queue`, which queues block i's upload into slot s on the upload stream (CUDA)."""
        queue()

    def wait_queued(self, s: int) -> None:
        """Return once slot s's upload has been queued (and its event recorded)."""

    def written_back(self, done: torch.cuda.Event, i: int, block: HostBlock, s: int, lo: int, hi: int) -> None:
        """CUDA: the write-back of elements [lo, hi) of block i from slot s is queued; `done` records
        its end on the device."""

    def drain(self) -> None:
        """Wait for the host-side work still running (re-raising its errors): the host masters and
        staging buffers are then the Python thread's to read and write."""

    def close(self) -> None:
        """Stop the host-side workers."""


class FullPrecisionTransfer(Transfer):
    """Blocks travel in the master's dtype: a slot and its host master hold the same values."""

    def upload(self, block: HostBlock, s: int, lo: int, hi: int) -> None:
        with self.meter.timed():
            self.slots[s][lo:hi].copy_(block.flat[lo:hi], non_blocking=True)
            self.meter.bytes_up += (hi - lo) * block.flat.element_size()

    def write_back(self, block: HostBlock, s: int, lo: int, hi: int) -> None:
        with self.meter.timed():
            block.flat[lo:hi].copy_(self.slots[s][lo:hi], non_blocking=True)
            self.meter.bytes_down += (hi - lo) * block.flat.element_size()


class ReducedPrecisionTransfer(Transfer):
    """Blocks travel narrowed to `transfer_dtype` and are widened in the slot; the host master keeps
    full precision and receives an update as its narrowed delta (`deltas`, filled by the update),
    added in place. Here (CPU) every copy and add runs on the calling thread."""

    exact = False  # the slot holds the update at full precision, the master its narrowed delta
    pinned = False  # host staging buffers page-locked (CUDA)

    def __init__(self, slots: Sequence[torch.Tensor], meter: TransferMeter, transfer_dtype: torch.dtype):
        super().__init__(slots, meter)
        self.transfer_dtype = transfer_dtype
        size, device = slots[0].numel(), slots[0].device
        self.host_stage = [host_buffer(size, transfer_dtype, self.pinned) for _ in slots]  # uploads
        self.host_delta = [host_buffer(size, transfer_dtype, self.pinned) for _ in slots]  # deltas back
        self.device_stage = [torch.empty(size, dtype=transfer_dtype, device=device) for _ in slots]
        self._deltas = [torch.zeros(size, dtype=torch.float32, device=device) for _ in slots]

    def deltas(self, s: int) -> torch.Tensor:
        return self._deltas[s]

    def upload(self, block: HostBlock, s: int, lo: int, hi: int) -> None:
        with self.meter.timed():
            self.host_stage[s][lo:hi].copy_(block.flat[lo:hi])  # narrow on the host
            self.device_stage[s][lo:hi].copy_(self.host_stage[s][lo:hi], non_blocking=True)
            self.slots[s][lo:hi].copy_(self.device_stage[s][lo:hi])  # widen on the device
            self.meter.bytes_up += (hi - lo) * self.host_stage[s].element_size()

    def write_back(self, block: HostBlock, s: int, lo: int, hi: int) -> None:
        with self.meter.timed():
            self.device_stage[s][lo:hi].copy_(self._deltas[s][lo:hi])  # narrow the delta on the device
            self.host_delta[s][lo:hi].copy_(self.device_stage[s][lo:hi], non_blocking=True)
            self.meter.bytes_down += (hi - lo) * self.host_delta[s].element_size()
        self._add_delta(block, s, lo, hi)

    def _add_delta(self, block: HostBlock, s: int, lo: int, hi: int) -> None:
        # Mixed-dtype in place: widened element by element, with no block-sized temporary.
        block.flat[lo:hi].add_(self.host_delta[s][lo:hi])


class CudaReducedPrecisionTransfer(ReducedPrecisionTransfer):
    """Reduced precision on CUDA. The host's work runs on two worker threads, so the Python thread
    queues the next blocks' kernels meanwhile instead of waiting for each write-back: one narrows
    blocks for upload (`queue_upload`), the other adds returned deltas to the masters
    (`written_back`); a block's narrowing waits only for its own last delta, and a delta buffer is
    reused only after the add that read it. Each staging buffer carries the event of the last
    upload that read it, waited for before it is overwritten."""

    pinned = True

    def __init__(self, slots: Sequence[torch.Tensor], meter: TransferMeter, transfer_dtype: torch.dtype):
        super().__init__(slots, meter, transfer_dtype)
        self._workers: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="distzo-narrow"),
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="distzo-delta"))
        self._jobs: list[Future] = []
        self._uploading: dict[int, Future] = {}  # slot -> its upload job (records the slot's upload event)
        self._adding: dict[int, Future] = {}  # block -> the add of its last delta
        self._delta_read: dict[int, Future] = {}  # slot -> the last add that read host_delta[slot]
        self._stage_read: list[torch.cuda.Event | None] = [None] * len(slots)  # last upload that read host_stage[s]

    def upload(self, block: HostBlock, s: int, lo: int, hi: int) -> None:
        with self.meter.timed():
            if self._stage_read[s] is not None:
                # The previous upload from this staging buffer may still be queued: overwriting
                # it now would send the wrong block (the host runs ahead of the GPU).
                self._stage_read[s].synchronize()
            self.host_stage[s][lo:hi].copy_(block.flat[lo:hi])  # narrow on the host (CPU work)
            self.device_stage[s][lo:hi].copy_(self.host_stage[s][lo:hi], non_blocking=True)
            self._stage_read[s] = torch.cuda.Event()
            self._stage_read[s].record()
            self.slots[s][lo:hi].copy_(self.device_stage[s][lo:hi])  # widen on the device
            self.meter.bytes_up += (hi - lo) * self.host_stage[s].element_size()

    def write_back(self, block: HostBlock, s: int, lo: int, hi: int) -> None:
        """The narrowed delta is queued to host_delta[s]; the delta worker adds it (`written_back`)."""
        with self.meter.timed():
            reading = self._delta_read.pop(s, None)
            if reading is not None:
                reading.result()  # the add that reads this delta buffer is done with it
            self.device_stage[s][lo:hi].copy_(self._deltas[s][lo:hi])  # narrow the delta on the device
            self.host_delta[s][lo:hi].copy_(self.device_stage[s][lo:hi], non_blocking=True)
            self.meter.bytes_down += (hi - lo) * self.host_delta[s].element_size()

    def queue_upload(self, i: int, s: int, queue: Callable[[], None]) -> None:
        """On the narrowing worker, after block i's last delta is in its master."""
        adding = self._adding.get(i)

        def job() -> None:
            if adding is not None:
                adding.result()  # the block's master holds its last delta
            queue()
        future = self._workers[0].submit(job)
        self._jobs.append(future)
        self._uploading[s] = future

    def wait_queued(self, s: int) -> None:
        job = self._uploading.pop(s, None)
        if job is not None:
            job.result()  # the worker has queued the upload and recorded its event

    def written_back(self, done: torch.cuda.Event, i: int, block: HostBlock, s: int, lo: int, hi: int) -> None:
        """Add block i's delta once its copy to the host (`done`) has landed, on the delta worker."""

        def job() -> None:
            done.synchronize()
            self._add_delta(block, s, lo, hi)
        future = self._workers[1].submit(job)
        self._jobs.append(future)
        self._adding[i] = self._delta_read[s] = future

    def drain(self) -> None:
        jobs, self._jobs, self._uploading, self._adding, self._delta_read = self._jobs, [], {}, {}, {}
        errors = [job.exception() for job in jobs]  # waits for every job, failed or not
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            raise failed

    def close(self) -> None:
        if self._workers is None:
            return
        try:
            self.drain()
        finally:
            for pool in self._workers:
                pool.shutdown(wait=True)
            self._workers = None


def make_transfer(slots: Sequence[torch.Tensor], master_dtype: torch.dtype, transfer_dtype: torch.dtype | None,
                  meter: TransferMeter) -> Transfer:
    """The transfer for blocks of `master_dtype` moved in `transfer_dtype` (None: their own)."""
    if transfer_dtype in (None, master_dtype):
        return FullPrecisionTransfer(slots, meter)
    if slots[0].device.type == "cuda":
        return CudaReducedPrecisionTransfer(slots, meter, transfer_dtype)
    return ReducedPrecisionTransfer(slots, meter, transfer_dtype)


# --- streamers: which block is in which slot, and the order of the copies ----------------------------


class BlockStreamer:
    """Moves whole blocks between their host masters and a ring of device slots, through the
    transfer `transfer_dtype` asks for (`make_transfer`).

    prefetch(i) starts block i's upload; acquire(i) makes the compute stream wait for it and
    returns the slot's views; release(i, write_back) returns the slot to the ring, first copying the
    block (or, at reduced precision, its update's delta) back to the host master. On CUDA uploads
    run on `upload_stream` and write-backs on `offload_stream`, ordered by events: `uploaded[s]`
    (slot s's last upload), `slot_free[s]` (the last use of slot s: a compute or a write-back) and
    `written[i]` (block i's last write-back). On CPU every copy is done when it returns.

    With optimizer state (`HostBlock.state`), each slot has state buffers too: a block that
    awaits the pending update (`awaits(i)`) has its state uploaded with it and written back with it;
    `state_needed(i)` (by default `awaits`) says which blocks' state goes up (also those without an
    update, where the state shapes the directions)."""

    def __init__(self, blocks: Sequence[HostBlock], device: torch.device, slots: int,
                 transfer_dtype: torch.dtype | None = None, awaits: Callable[[int], bool] | None = None,
                 state_needed: Callable[[int], bool] | None = None):
        self.blocks, self.device = blocks, device
        self.cuda = device.type == "cuda"
        dtype = blocks[0].flat.dtype
        size = max(b.padded.numel() for b in blocks)
        n = min(slots, len(blocks))
        self.slots = [torch.empty(size, dtype=dtype, device=device) for _ in range(n)]
        self.owner: list[int | None] = [None] * n  # block whose current weights fill the slot
        self._awaits = awaits or (lambda i: False)
        self._state_needed = state_needed or self._awaits
        self.state_slots = [tuple(torch.empty(size, dtype=torch.float32, device=device) for _ in blocks[0].state)
                            for _ in range(n)]
        self.state_owner: list[int | None] = [None] * n  # block whose current state fills the slot's state buffers
        self.meter = TransferMeter(self.cuda)
        self.transfer = make_transfer(self.slots, dtype, transfer_dtype, self.meter)
        if self.cuda:
            self.upload_stream = torch.cuda.Stream(device)
            self.offload_stream = torch.cuda.Stream(device)
            self.uploaded = [torch.cuda.Event() for _ in range(n)]
            self.slot_free: list[torch.cuda.Event | None] = [None] * n
            self.written: dict[int, torch.cuda.Event] = {}  # block -> its last write-back

    def slot_of(self, i: int) -> int:
        return i % len(self.slots)

    def transfer_seconds(self) -> float:
        self.transfer.drain()  # uploads a host worker queued have recorded their timing events
        return self.meter.seconds()

    def stats(self) -> dict[str, float]:
        """Bytes moved up, down and between peers so far, and the seconds the transfers took."""
        m = self.meter
        return {"h2d_bytes": m.bytes_up, "d2h_bytes": m.bytes_down, "peer_bytes": m.bytes_peer,
                "transfer_s": self.transfer_seconds()}

    def prefetch_from(self, i: int) -> None:
        """Queue block i and the next blocks the slots can hold: their uploads overlap i's compute."""
        for j in range(i, min(i + len(self.slots), len(self.blocks))):
            self.prefetch(j)

    def state_views(self, i: int) -> dict[str, tuple[torch.Tensor, ...]]:
        """Block i's optimizer state in its slot, by parameter (the block must have been prefetched
        owing an update)."""
        s = self.slot_of(i)
        if self.state_owner[s] != i:
            raise RuntimeError(f"internal error: block {i}'s optimizer state is not in its slot")
        per_slot = [self.blocks[i].views(buf) for buf in self.state_slots[s]]
        return {name: tuple(v[name] for v in per_slot) for name in self.blocks[i].names}

    def forget_state(self) -> None:
        """The host state changed (a snapshot's was loaded): no slot holds a current copy."""
        self.state_owner = [None] * len(self.slots)

    def _upload_state(self, block: HostBlock, s: int, lo: int, hi: int) -> None:
        """Elements [lo, hi) of the block's optimizer state into slot s's state buffers (full precision)."""
        with self.meter.timed():
            for host, dev in zip(block.state, self.state_slots[s]):
                dev[lo:hi].copy_(host[lo:hi], non_blocking=True)
                self.meter.bytes_up += (hi - lo) * host.element_size()

    def _write_back_state(self, block: HostBlock, s: int, lo: int, hi: int) -> None:
        with self.meter.timed():
            for host, dev in zip(block.state, self.state_slots[s]):
                host[lo:hi].copy_(dev[lo:hi], non_blocking=True)
                self.meter.bytes_down += (hi - lo) * host.element_size()

    def delta_views(self, i: int) -> dict[str, torch.Tensor] | None:
        """Block i's parameters as views of its slot's delta buffer (reduced precision), or None."""
        deltas = self.transfer.deltas(self.slot_of(i))
        return None if deltas is None else self.blocks[i].views(deltas)

    def prefetch(self, i: int) -> None:
        s = self.slot_of(i)
        state = bool(self.state_slots[s]) and self.state_owner[s] != i and self._state_needed(i)
        if self.owner[s] == i and not state:
            return
        weights = self.owner[s] != i
        self.owner[s] = i
        if state:
            self.state_owner[s] = i
        block = self.blocks[i]
        if not self.cuda:
            if weights:
                self.transfer.upload(block, s, 0, block.numel)
            if state:
                self._upload_state(block, s, 0, block.numel)
            return
        # The events as they are now: the transfer may queue the upload later, on a host worker.
        slot_free, written = self.slot_free[s], self.written.get(i)

        def queue() -> None:
            with torch.cuda.device(self.device), torch.cuda.stream(self.upload_stream):
                self._wait_for_slot(slot_free, written)
                if weights:
                    self.transfer.upload(block, s, 0, block.numel)
                if state:
                    self._upload_state(block, s, 0, block.numel)
                self.uploaded[s].record(self.upload_stream)

        self.transfer.queue_upload(i, s, queue)

    def _wait_for_slot(self, slot_free: torch.cuda.Event | None, written: torch.cuda.Event | None) -> None:
        """The upload stream waits for the slot's previous block (`slot_free[s]`) and for the block's
        last write-back (`written[i]`), taken when the upload was queued."""
        if slot_free is not None:
            self.upload_stream.wait_event(slot_free)  # the slot's previous block is done
        if written is not None:
            self.upload_stream.wait_event(written)  # the host master is current

    def acquire(self, i: int) -> dict[str, torch.Tensor]:
        self.prefetch(i)
        s = self.slot_of(i)
        self.transfer.wait_queued(s)
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(self.uploaded[s])
            if self.slot_free[s] is not None:  # a block kept in its slot: its last write-back has read it
                compute.wait_event(self.slot_free[s])
        return self.blocks[i].views(self.slots[s])

    def release(self, i: int, write_back: bool) -> None:
        """Done computing with block i. write_back: copy it (or its delta) to the host master."""
        s, block = self.slot_of(i), self.blocks[i]
        if write_back and not self.transfer.exact:
            # The slot holds the update at full precision, the host master its narrowed delta: the
            # next use must upload again to see exactly what every other path sees.
            self.owner[s] = None
        state = write_back and self.state_owner[s] == i and bool(self.state_slots[s])
        if not self.cuda:
            if write_back:
                self.transfer.write_back(block, s, 0, block.numel)
            if state:
                self._write_back_state(block, s, 0, block.numel)
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
            self.transfer.write_back(block, s, 0, block.numel)
            if state:
                self._write_back_state(block, s, 0, block.numel)
            done = torch.cuda.Event()
            done.record(self.offload_stream)
        self.slot_free[s] = self.written[i] = done
        self.transfer.written_back(done, i, block, s, 0, block.numel)

    def synchronize(self) -> None:
        """Wait for every write-back: the host masters are then safe to read."""
        self.transfer.drain()
        if self.cuda:
            self.offload_stream.synchronize()
            self.upload_stream.synchronize()

    def close(self) -> None:
        """Stop the host workers (after the last delta reached its master); on CUDA wait for the
        streams and unregister the page-locked host buffers before their memory can go."""
        try:
            self.transfer.close()
            if self.cuda:
                self.synchronize()
        finally:
            if self.cuda:
                unpin_all()


@contextmanager
def streamed_stock_forward(adapter: DecoderAdapter, streamer: BlockStreamer,
                           tensors: Callable[[int], Mapping[str, torch.Tensor]] | None = None) -> Iterator[None]:
    """Inside: the stock model's own forward (transformers' Trainer evaluating) reads streamed blocks
    (ZO2's offloaded inference). As the forward reaches block i, the streamer uploads it (and starts
    the next ones); its tensors by full parameter name (`tensors(i)`, by default what the streamer's
    `acquire` returns) stand in for the block's parameters as `call_with` swaps them; after the block
    the parameters are put back and its slot is released, nothing written back."""
    swapped: dict[int, list[tuple[nn.Module, str, Any]]] = {}

    def acquire(i: int) -> Mapping[str, torch.Tensor]:
        streamer.prefetch_from(i)
        acquired = streamer.acquire(i)
        return tensors(i) if tensors is not None else acquired

    def enter(i: int, prefix: str, slots: dict[str, tuple[nn.Module, str]]) -> None:
        saved = []
        for name, tensor in acquire(i).items():
            sub, attr = slots[name[len(prefix) + 1:]]
            saved.append((sub, attr, sub._parameters[attr]))
            sub._parameters[attr] = tensor
        swapped[i] = saved

    def leave(i: int) -> None:
        for sub, attr, old in reversed(swapped.pop(i)):
            sub._parameters[attr] = old
        streamer.release(i, write_back=False)

    hooks = []
    for i, (prefix, module) in enumerate(adapter.blocks):
        slots = parameter_slots(module)
        hooks.append(module.register_forward_pre_hook(lambda _m, _a, i=i, prefix=prefix, slots=slots:
                                                      enter(i, prefix, slots)))
        hooks.append(module.register_forward_hook(lambda _m, _a, _o, i=i: leave(i)))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for i in list(swapped):  # a forward that raised inside a block
            leave(i)
        streamer.synchronize()


# (block index, the slot's flat buffer, [lo, hi) of the block, the slot's float32 delta buffer or None)
SliceUpdate = Callable[[int, torch.Tensor, int, int, "torch.Tensor | None"], None]


class SlicedBlockStreamer(BlockStreamer):
    """DistZO2's sliced streaming over the ranks of a node sharing one host master: prefetch(i)
    uploads this rank's slice of block i, has `update` apply the pending update to it (when `awaits(i)`),
    writes the slice back, and all-gathers the other slices from the node's peers; `flush_slice`
    brings this rank's slice of the master up to date with no collective. Inside `local_reads`
    whole blocks are uploaded instead, with no collective, since ranks evaluate different numbers
    of batches."""

    def __init__(self, blocks: Sequence[HostBlock], device: torch.device, slots: int,
                 transfer_dtype: torch.dtype | None, node: Node, *, awaits: Callable[[int], bool],
                 update: SliceUpdate):
        super().__init__(blocks, device, slots, transfer_dtype, awaits=awaits)
        self.node, self.part = node, node.local_rank
        self._update = update
        self._local = False

    @contextmanager
    def local_reads(self) -> Iterator[None]:
        """Whole blocks from the (flushed) master, with no collective."""
        self._local = True
        try:
            yield
        finally:
            self._local = False
            # Ranks ran different numbers of local reads, so which blocks sit whole in which slot now
            # differs between them; forget it, or the next collective walk would skip the all-gather on
            # some ranks only and deadlock.
            self.owner = [None] * len(self.slots)

    def prefetch(self, i: int) -> None:
        """My slice up, its pending update, my slice back, the peers' slices in."""
        if self._local:
            super().prefetch(i)
            return
        s, block = self.slot_of(i), self.blocks[i]
        lo, hi = block.slice_range(self.part)
        current = self.owner[s] == i
        if current and not self._awaits(i):
            # Prefetched already (acquire follows the prefetches of the next blocks): recording the
            # upload event again would make block i's compute wait for everything queued since.
            return

        def work() -> None:
            if not current:
                self.transfer.upload(block, s, lo, hi)
            updated = self._awaits(i)
            if updated:
                self._update_own_slice(i, s, lo, hi)
            if updated or not current:
                self._gather(block, s)

        self.owner[s] = i
        if not self.cuda:
            work()
            return
        self.transfer.drain()  # this thread narrows now: earlier deltas must be in the master
        with torch.cuda.stream(self.upload_stream):
            self._wait_for_slot(self.slot_free[s], self.written.get(i))
            written_before = self.meter.bytes_down
            work()
            if self.meter.bytes_down != written_before:
                done = torch.cuda.Event()
                done.record(self.upload_stream)
                self.written[i] = done
                self.transfer.written_back(done, i, block, s, lo, hi)
            self.uploaded[s].record(self.upload_stream)

    def flush_slice(self, i: int) -> None:
        """Bring my slice of block i's host master up to date (no collective)."""
        s, block = self.slot_of(i), self.blocks[i]
        lo, hi = block.slice_range(self.part)
        self.owner[s] = None  # the slot ends with only my slice current

        def work() -> bool:
            self.transfer.upload(block, s, lo, hi)
            updated = self._awaits(i)
            if updated:
                self._update_own_slice(i, s, lo, hi)
            return updated

        if not self.cuda:
            work()
            return
        self.transfer.drain()
        with torch.cuda.stream(self.upload_stream):
            self._wait_for_slot(self.slot_free[s], self.written.get(i))
            if work():
                done = torch.cuda.Event()
                done.record(self.upload_stream)
                self.written[i] = self.slot_free[s] = done
                self.transfer.written_back(done, i, block, s, lo, hi)

    def _update_own_slice(self, i: int, s: int, lo: int, hi: int) -> None:
        """The pending update of my slice of block i, in slot s (its optimizer state up before it and
        back after it), and the slice back to the host master."""
        block = self.blocks[i]
        if self.state_slots[s]:
            self._upload_state(block, s, lo, hi)
            self.state_owner[s] = i  # my slice's state is current in the slot (the rest is not)
        self._update(i, self.slots[s], lo, hi, self.transfer.deltas(s))
        self.transfer.write_back(block, s, lo, hi)
        if self.state_slots[s]:
            self._write_back_state(block, s, lo, hi)
            self.state_owner[s] = None

    def release(self, i: int, write_back: bool) -> None:
        if not self._local and not self.transfer.exact:
            # My slice may have been updated: the slot holds it at full precision, the master its
            # narrowed delta, so the next use uploads again.
            self.owner[self.slot_of(i)] = None
        super().release(i, write_back)

    def _gather(self, block: HostBlock, s: int) -> None:
        """Every peer's slice of the block into this slot (this rank's slice is already there)."""
        padded = self.slots[s][:block.padded.numel()]
        parts = list(padded.split(block.slice_len))
        with self.meter.timed():
            if self.cuda:  # NCCL gathers in place into one buffer
                dist.all_gather_into_tensor(padded, parts[self.part], group=self.node.device_group)
            else:  # gloo takes a list of outputs; the input must not alias one of them
                dist.all_gather(parts, parts[self.part].clone(), group=self.node.device_group)
        self.meter.bytes_peer += (block.parts - 1) * block.slice_len * block.flat.element_size()
