"""Where an optimizer's per-element state lives (docs/optimizers.md#where-the-state-lives).

The rules (`distzo.zo.optimizers`) say what the state is: one or two float32 tensors shaped like
each trainable parameter. This module holds them where the engine's mode holds the master:

- `StateBuffers`: parameters on the compute device (resident, P-RGE's LoRA B, an offloaded run's
  outer stage), one flat buffer per slot with a view per parameter; with a `node`, the buffers are
  node-shared host memory that every rank of the machine maps (work division: one copy per node,
  each chunk's state written by the rank that owns the chunk).
- offloaded blocks keep theirs beside their host masters, in the same layout, streamed with the
  blocks (`streamer.HostBlock.state`).

Snapshots name a state tensor `<slot>/<parameter>` (`state_key`).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..parallel.node import Node
from ..zo.params import TrainableParam


def state_key(slot: str, name: str) -> str:
    """A state tensor's name in snapshots: its slot and its parameter's canonical name."""
    return f"{slot}/{name}"


class StateBuffers:
    """The state of `params` for an optimizer with `slots`: a flat float32 buffer per slot (every
    element `initial` at the start), on `device`, or node-shared when `node` has several ranks (local
    rank 0 fills it)."""

    def __init__(self, slots: Sequence[str], params: Sequence[TrainableParam], device: torch.device,
                 node: Node | None = None, initial: float = 0.0):
        self.slots, self.params = tuple(slots), list(params)
        self.node = node if node is not None and node.shared else None
        total = sum(p.numel() for p in self.params)
        self.flat: list[torch.Tensor] = []
        for slot in self.slots:
            if self.node is not None:
                buf = self.node.shared_tensor(total, torch.float32, f"optim-{slot}")
                if self.node.local_rank == 0:
                    buf.fill_(initial)
            else:
                with torch.inference_mode(False):
                    buf = torch.full((total,), initial, dtype=torch.float32, device=device)
            self.flat.append(buf)
        if self.node is not None and self.slots:
            self.node.barrier()  # filled before anyone reads it
        self._views: dict[str, tuple[torch.Tensor, ...]] = {}
        offset = 0
        for p in self.params:
            self._views[p.name] = tuple(buf[offset:offset + p.numel()].view(p.shape) for buf in self.flat)
            offset += p.numel()

    def of(self, p: TrainableParam) -> tuple[torch.Tensor, ...]:
        return self._views.get(p.name, ())

    def export(self) -> dict[str, torch.Tensor]:
        return {state_key(slot, p.name): t for p in self.params for slot, t in zip(self.slots, self.of(p))}

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy a snapshot's state in (every rank calls it; with a node, local rank 0 writes)."""
        if self.node is None or self.node.local_rank == 0:
            with torch.no_grad():
                for p in self.params:
                    for slot, t in zip(self.slots, self.of(p)):
                        t.copy_(tensors[state_key(slot, p.name)])
        if self.node is not None and self.slots:
            self.node.barrier()

    def nbytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf in self.flat)
