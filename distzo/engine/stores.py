"""Weight stores: where the master weights live, and how block i becomes what a forward reads.

The step loop (`distzo.engine.loop.StageLoop`) asks a store for three things: the outer stage's
masters (embeddings, final norm, head: always on the compute device), block i for the duration of
its compute (`block(i)`: the tensors the forward reads, and where the pending update reaches the
block's masters meanwhile), and a flush of block i. The store also holds the optimizer's state
beside the masters and reports what it moves and keeps (telemetry every store has, so the driver
never asks which mode runs).

| store | where the master is | module |
|---|---|---|
| `ResidentStore` | the parameters, on the compute device | here |
| `NodeSharedStore` | one copy in host memory every rank of the machine maps (work division) | `engine/divided.py` |
| `OffloadStore` | a host buffer per block, streamed whole through a ring of device slots | `engine/offload.py` |
| `SlicedOffloadStore` | one node-shared host master; each rank moves a slice of every block | `engine/offload.py` |

A new place for the weights (a quantized base, a disk tier) is a new store: the loop does not change.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Iterator, Mapping, NamedTuple, Sequence

import torch

from ..zo.optimizers import Optimizer
from ..zo.params import TrainableParam, TrainableParams
from .optstate import StateBuffers
from .pending import Target

if TYPE_CHECKING:
    from ..models.adapters import DecoderAdapter
    from .loop import StageLoop

OUTER = "outer"  # the stage of every trainable parameter outside the blocks (embeddings, norms, head)


class Block(NamedTuple):
    """Block i while it computes: `sources`, the tensors holding its parameters on the compute device
    (None: the parameters themselves), and `targets`, where the pending update reaches its trainable
    masters meanwhile."""

    sources: Mapping[str, torch.Tensor] | None
    targets: list[Target]


class WeightStore:
    """Where the master lives (see the module docstring); this base holds the layout every store
    shares: the trainable parameters of each block and of the outer stage.

    walks_with_peers: a rank dealt no probe must still walk every block with its peers (blocks that
    arrive through collectives)."""

    walks_with_peers = False

    def __init__(self, adapter: DecoderAdapter, params: TrainableParams, optimizer: Optimizer, device: torch.device):
        for p in params:
            if not p.tensor.is_contiguous():
                raise ValueError(f"parameter {p.name} is not contiguous; the chunked update needs flat views")
        self.adapter, self.params, self.optimizer, self.device = adapter, params, optimizer, device
        self.block_params = [[p for p in params if p.name.startswith(prefix + ".")] for prefix, _ in adapter.blocks]
        in_blocks = {p.name for ps in self.block_params for p in ps}
        self.outer_params = [p for p in params if p.name not in in_blocks]
        self.loop: StageLoop | None = None

    @property
    def blocks(self) -> int:
        return len(self.block_params)

    def attach(self, loop: StageLoop) -> None:
        """The loop whose pending update this store's blocks await (stores that update a block
        during its transfer call `loop.update_stage`)."""
        self.loop = loop

    # --- what the loop asks -------------------------------------------------------------------------

    def outer_targets(self) -> list[Target]:
        raise NotImplementedError

    def block(self, i: int):
        """Context: block i while it computes (`Block`)."""
        raise NotImplementedError

    def resident_targets(self, i: int) -> list[Target]:
        """Block i's targets where its masters are the parameters (the look-ahead of work division)."""
        raise RuntimeError(f"internal error: {type(self).__name__} does not keep block {i} resident")

    def flush_block(self, i: int) -> None:
        """A flush reaches block i, which awaits the pending update."""
        with self.block(i) as b:
            self.loop.update_stage(i, b.targets)

    def synchronize(self) -> None:
        """Wait for asynchronous copies to the masters (no collectives): before they are read."""

    def after_flush(self) -> None:
        """After a flush has updated every block (and `synchronize` returned)."""

    def local_reads(self):
        """Context in which forwards read the (flushed) master without collectives."""
        return nullcontext()

    def stock_forward(self):
        """Context (inside `local_reads`) in which the stock model's own forward runs on the compute
        device (transformers' Trainer evaluating and predicting): nothing to do where the model's
        parameters are there already."""
        return nullcontext()

    # --- the optimizer's state, beside the masters ---------------------------------------------------

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """The optimizer's state by `<slot>/<parameter>` (read inside `materialized`: current)."""
        raise NotImplementedError

    def load_optimizer_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def state_resident_bytes(self) -> int:
        """What this rank holds of the optimizer's state (its share where the node shares one copy)."""
        raise NotImplementedError

    # --- telemetry and the rest ---------------------------------------------------------------------

    def transfer_stats(self) -> dict[str, float]:
        """Cumulative bytes this rank moved host-to-device, back, and from node peers, and seconds spent
        in those transfers; {} for a store that moves nothing."""
        return {}

    def host_master_bytes(self) -> dict[str, int]:
        """A host master's memory: `copy` (one copy of it), `resident` (what this rank holds of it) and
        `node_shared` (whether the node's ranks share one copy); {} for a store without one."""
        return {}

    def describe(self) -> str:
        raise NotImplementedError

    def close(self) -> None:
        """Release buffers and workers."""


class ResidentStore(WeightStore):
    """Every weight on the compute device: the parameters are the masters, the state beside them."""

    def __init__(self, adapter: DecoderAdapter, params: TrainableParams, optimizer: Optimizer, device: torch.device,
                 state: StateBuffers | None = None):
        super().__init__(adapter, params, optimizer, device)
        if state is None:
            state = StateBuffers(optimizer.slots, list(params), device, initial=optimizer.initial)
        self.state = state

    def _targets(self, params: Sequence[TrainableParam]) -> list[Target]:
        return [Target(p, p.tensor, state=self.state.of(p)) for p in params]

    def outer_targets(self) -> list[Target]:
        return self._targets(self.outer_params)

    def resident_targets(self, i: int) -> list[Target]:
        return self._targets(self.block_params[i])

    @contextmanager
    def block(self, i: int) -> Iterator[Block]:
        yield Block(None, self._targets(self.block_params[i]))

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        return self.state.export()

    def load_optimizer_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.state.load(tensors)

    def state_resident_bytes(self) -> int:
        return self.state.nbytes()

    def describe(self) -> str:
        return "resident"
