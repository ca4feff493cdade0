"""Replica consistency (docs/architecture.md#invariants, I1): every rank must hold bit-identical master
weights after every step.

The check is an exact checksum of the weights' bit patterns (the integer sum of each tensor viewed
as integers, so it is order-independent and any single changed bit changes it), all-gathered and
compared. It costs one read of the weights; the driver runs it every `replica_check_every` steps and
after the last step.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..errors import DistzoError
from .mesh import Mesh

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SLICE = 1 << 22  # elements per partial sum: bounds the int64 temporary


class ReplicaDivergence(DistzoError):
    """Ranks hold different weights; the run cannot continue."""


def weights_checksum(tensors: Iterable[torch.Tensor]) -> int:
    """The exact checksum of the tensors' bits, in order."""
    total = 0
    for i, tensor in enumerate(tensors):
        bits = tensor.detach().reshape(-1).view(_INT_VIEW[tensor.element_size()])
        for lo in range(0, bits.numel(), _SLICE):
            # Mix in the position so swapped tensors do not cancel out.
            total += (i + 1) * int(bits[lo:lo + _SLICE].to(torch.int64).sum())
    return total & ((1 << 63) - 1)


def check_replicas(mesh: Mesh, tensors: Iterable[torch.Tensor], step: int) -> list[int]:
    """Every rank's checksum of its weights (`tensors`, in the same order on every rank), in rank
    order; raises ReplicaDivergence on every rank if any rank's weights differ from rank 0's."""
    sums = mesh.all_gather_int(weights_checksum(tensors))
    differ = [r for r, s in enumerate(sums) if s != sums[0]]
    if differ:
        raise ReplicaDivergence(
            f"replica weights diverged at step {step}: ranks {differ} differ from rank 0 "
            f"(checksums {sums}); ranks must run the same code, torch build and device type"
        )
    return sums
