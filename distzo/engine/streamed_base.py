"""A frozen base streamed from host memory under resident adapters (offload=cpu with peft).

With LoRA, LoRA-FA or prefix tuning only the adapters train. Their masters (and the optimizer's
state) stay on the compute device and are updated in place, as resident; the base's block
parameters are frozen, so they live in host memory and stream through a ring of device slots every
walk, read-only: uploaded, never written back. A quantized base (model.quantize) streams in its
quantized form: each block is one byte buffer holding every frozen tensor as stored (a torchao
tensor as its inner tensors: int8 or NF4 values and their scales), rebuilt on the device as views
of the slot, so a step moves the quantized bytes and the forward reads exactly the resident run's
weights (bitwise the same result).

The streamers are offloading's own (`distzo.engine.streamer`): whole blocks through the slot ring
(`BlockStreamer`, prefetching the next blocks while one computes, on CUDA streams ordered by
events), or DistZO2's sliced upload (`SlicedBlockStreamer`, `comm.sliced=true` with several ranks on a
node): one node-shared host copy, each rank uploads its slice of every block's bytes and
all-gathers the others from its peers. A frozen block awaits no update, so nothing goes back.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from ..models.adapters import DecoderAdapter, full_name
from ..parallel.node import Node, mapped_resident_bytes
from ..registry import register
from ..zo.optimizers import SGD, Optimizer
from ..zo.params import TrainableParams
from .base import EngineConfigError
from .build import EngineMode, EngineSetup
from .loop import StageLoop
from .stacked import StackedProbes
from .stores import Block, ResidentStore
from .streamer import (
    SLICE_ALIGN,
    BlockStreamer,
    HostBlock,
    SlicedBlockStreamer,
    _pin,
    host_buffer,
    place_resident,
    streamed_stock_forward,
)

ALIGN = 16  # bytes: every inner tensor starts where any dtype's view of it is aligned


@dataclass(frozen=True)
class Piece:
    """One stored tensor of a frozen parameter in its block's byte buffer: `attr` (the inner tensor
    of a torchao tensor, "" for a plain tensor), its byte offset, dtype and shape."""

    attr: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class FrozenTensor:
    """How to rebuild one frozen parameter from its block's bytes: `cls` (a torchao tensor's class,
    None for a plain tensor), its flatten context, outer shape and stride."""

    name: str
    pieces: tuple[Piece, ...]
    cls: Any = None
    context: Any = None
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()

    def rebuild(self, data: torch.Tensor) -> torch.Tensor:
        """The parameter as views of `data` (a block's byte buffer: host master or device slot)."""
        inner = {p.attr: data[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape) for p in self.pieces}
        if self.cls is None:
            return inner[""]
        return self.cls.__tensor_unflatten__(inner, self.context, torch.Size(self.shape), self.stride)


def _stored(tensor: torch.Tensor) -> tuple[Any, Any, list[tuple[str, torch.Tensor]]]:
    """(class, context, [(attr, inner tensor)]) of a torchao tensor; (None, None, [("", tensor)]) of a plain one."""
    if type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):
        names, context = tensor.__tensor_flatten__()
        return type(tensor), context, [(n, getattr(tensor, n)) for n in names]
    return None, None, [("", tensor)]


def frozen_layout(prefix: str, module: nn.Module, trainable: set[str]) -> tuple[list[FrozenTensor], int]:
    """Where each frozen parameter of a block lies in its byte buffer, and the buffer's size."""
    layout, offset = [], 0
    for rel, p in module.named_parameters():
        name = full_name(prefix, rel)
        if name in trainable:
            continue
        cls, context, inner = _stored(p.detach())
        pieces = []
        for attr, t in inner:
            offset += (-offset) % ALIGN
            piece = Piece(attr, offset, t.dtype, tuple(t.shape))
            pieces.append(piece)
            offset += piece.nbytes
        layout.append(FrozenTensor(name, tuple(pieces), cls, context, tuple(p.shape), tuple(p.stride())))
    return layout, offset


def _write(data: torch.Tensor, frozen: FrozenTensor, tensor: torch.Tensor) -> None:
    _, _, inner = _stored(tensor.detach())
    for piece, (_, t) in zip(frozen.pieces, inner):
        # A fresh row-major copy: a size-1 dimension may carry any stride, which a byte view refuses.
        flat = torch.empty(t.numel(), dtype=t.dtype, device=t.device).copy_(t.reshape(-1))
        data[piece.offset:piece.offset + piece.nbytes].copy_(flat.view(torch.uint8))


class StreamedBaseStore(ResidentStore):
    """The adapters resident (their masters and state on the device, updated in place), the frozen
    base's blocks streamed from host byte buffers (see the module docstring). node: the node whose
    ranks share one host copy, each moving a slice of every block (None: a private copy, whole blocks)."""

    def __init__(self, model: nn.Module, adapter: DecoderAdapter, params: TrainableParams, optimizer: Optimizer,
                 device: torch.device, *, slots: int = 3, node: Node | None = None):
        self.node = node
        self.walks_with_peers = node is not None  # blocks arrive through the node's all-gathers
        trainable = {p.name for p in params}
        self.layouts, sizes = zip(*(frozen_layout(prefix, module, trainable) for prefix, module in adapter.blocks))
        if not any(sizes):
            raise EngineConfigError("offload=cpu streams the frozen base's blocks, and this model's blocks hold no "
                                    "frozen parameter; use offload=none")
        self.host_blocks = self._host_blocks(model, list(sizes), pin=device.type == "cuda")
        place_resident(model, device, (f.name for layout in self.layouts for f in layout))
        super().__init__(adapter, params, optimizer, device)
        if node is None:
            self.streamer = BlockStreamer(self.host_blocks, device, slots)
        else:
            self.streamer = SlicedBlockStreamer(self.host_blocks, device, slots, None, node, awaits=lambda i: False,
                                                update=self._no_update)

    def _host_blocks(self, model: nn.Module, sizes: list[int], pin: bool) -> list[HostBlock]:
        """Every block's frozen tensors copied into its host byte buffer (one node-shared buffer
        when sliced, each block padded to `parts` aligned slices), and the model's parameters
        re-pointed at them, so the base is held once, in host memory."""
        parts = self.node.size if self.node is not None else 1
        slice_lens = [math.ceil(math.ceil(size / parts) / SLICE_ALIGN) * SLICE_ALIGN if parts > 1 else size
                      for size in sizes]
        shared = None
        if self.node is not None:
            shared = self.node.shared_tensor(sum(parts * s for s in slice_lens), torch.uint8, "frozen-base")
            if pin:
                _pin(shared)
        blocks, start = [], 0
        for layout, size, slice_len in zip(self.layouts, sizes, slice_lens):
            if shared is not None:
                padded = shared[start:start + parts * slice_len]
                start += parts * slice_len
            else:
                padded = host_buffer(size, torch.uint8, pin)
            data = padded[:size]
            for frozen in layout:
                owner, _, attr = frozen.name.rpartition(".")
                module = model.get_submodule(owner)
                if self.node is None or self.node.local_rank == 0:
                    _write(data, frozen, getattr(module, attr))
                # The model holds the base once: its parameters become views of the host copy.
                setattr(module, attr, nn.Parameter(frozen.rebuild(data), requires_grad=False))
            names = [f"{f.name}#{p.attr}" for f in layout for p in f.pieces]
            shapes = [torch.Size([p.nbytes]) for f in layout for p in f.pieces]
            offsets = [p.offset for f in layout for p in f.pieces]
            blocks.append(HostBlock("", names, shapes, offsets, data, padded, slice_len, parts))
        if self.node is not None:
            self.node.barrier()  # local rank 0 has filled the shared copy
        return blocks

    @staticmethod
    def _no_update(i: int, slot: torch.Tensor, lo: int, hi: int, delta: torch.Tensor | None) -> None:
        raise RuntimeError(f"internal error: frozen block {i} was asked to take an update")

    def _sources(self, i: int) -> dict[str, torch.Tensor]:
        """Block i's frozen parameters as views of its slot (the streamer has just acquired it)."""
        slot = self.streamer.slots[self.streamer.slot_of(i)]
        return {f.name: f.rebuild(slot) for f in self.layouts[i]}

    @contextmanager
    def block(self, i: int) -> Iterator[Block]:
        """Block i's frozen tensors uploaded (the next blocks' prefetched), the adapters as resident."""
        with self.loop.timers("transfer"):
            self.streamer.prefetch_from(i)
            self.streamer.acquire(i)
        try:
            yield Block(self._sources(i), self._targets(self.block_params[i]))
        finally:
            with self.loop.timers("transfer"):
                self.streamer.release(i, write_back=False)

    def flush_block(self, i: int) -> None:
        """The adapters are resident: a flush updates them where they are, moving nothing."""
        self.loop.update_stage(i, self._targets(self.block_params[i]))

    def local_reads(self):
        """Evaluation: whole blocks from the shared host copy, with no collective."""
        return self.streamer.local_reads() if self.node is not None else super().local_reads()

    def synchronize(self) -> None:
        self.streamer.synchronize()

    def stock_forward(self, force: bool = False):
        """The stock model's forward on the compute device, the frozen base's blocks streamed
        (`streamed_stock_forward`); on a CPU the host copy is the forward's own parameters and nothing
        is done (force: stream anyway, the tests' check)."""
        if self.device.type == "cpu" and not force:
            return nullcontext()
        return streamed_stock_forward(self.adapter, self.streamer, self._sources)

    def host_master_bytes(self) -> dict[str, int]:
        copy = sum(b.numel for b in self.host_blocks)
        if self.node is None:
            return {"copy": copy, "resident": copy, "node_shared": False}
        return {"copy": copy, "resident": mapped_resident_bytes(self.host_blocks[0].flat)["pss"], "node_shared": True}

    def transfer_stats(self) -> dict[str, float]:
        return self.streamer.stats()

    def describe(self) -> str:
        kinds = {f.cls.__name__ for layout in self.layouts for f in layout if f.cls is not None}
        form = f" ({', '.join(sorted(kinds))})" if kinds else ""
        sliced = f", one node-shared copy sliced over {self.node.size} ranks" if self.node is not None else ""
        return f"adapters resident, the frozen base{form} streamed from host memory{sliced}"

    def close(self) -> None:
        self.streamer.close()



def streamed_base_engine(model, adapter, params, directions, *, slots: int = 3, node: Node | None = None,
                         stacked: StackedProbes | None = None, optimizer: Optimizer | None = None,
                         **kwargs) -> StageLoop:
    """Adapters resident, the frozen (possibly quantized) base streamed from host memory, whole or
    sliced over the node's ranks."""
    optimizer = optimizer or SGD()
    store = StreamedBaseStore(model, adapter, params, optimizer, directions.device, slots=slots, node=node)
    mode = "offload-base-sliced" if node is not None else "offload-base"
    return StageLoop(model, adapter, params, directions, store, stacked=stacked, optimizer=optimizer, mode=mode,
                     **kwargs)


@register("engine_mode", "offload-base")
class StreamedBaseMode(EngineMode):
    """offload=cpu with adapters (peft): the adapters resident, the frozen base streamed whole, or, as
    `offload-base-sliced`, one node-shared host copy of it sliced over the node's ranks (comm.sliced)."""

    precedence, sliced = 40, False

    @classmethod
    def applies(cls, s: EngineSetup) -> bool:
        return s.offload.mode == "cpu" and s.peft_method != "none" and (s.node_shared or not cls.sliced)

    @classmethod
    def build(cls, s: EngineSetup) -> StageLoop:
        stacked = (StackedProbes(s.model, s.params, getattr(s.estimator, "materialize", True))
                   if s.estimator.stacked else None)
        return streamed_base_engine(s.model, s.adapter, s.params, s.directions, slots=s.offload.slots,
                                    node=s.mesh.node if cls.sliced else None, stacked=stacked, **s.loop_options())


@register("engine_mode", "offload-base-sliced")
class SlicedStreamedBaseMode(StreamedBaseMode):
    precedence, sliced = 41, True
