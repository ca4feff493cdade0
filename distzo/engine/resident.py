"""The resident engine: every weight lives on the compute device; the update lands at once.

Embedding-like tables are perturbed by rows: the stem needs only the rows of the batch's tokens and
the label head only the label words' rows, so no stage copies a vocabulary-sized matrix. Stage noise
and working copies live in a reused workspace and chunk temporaries in per-thread scratch buffers,
so no step allocates parameter-sized tensors afresh.
"""

from __future__ import annotations

from typing import Sequence

from .base import StagedEngine
from .update import apply_update


class ResidentEngine(StagedEngine):
    def update(self, step: int, coefficients: Sequence[tuple[int, float]], lr: float, weight_decay: float) -> None:
        """theta -= lr * (sum_k c_k z_k + weight_decay * theta), z regenerated chunk by chunk."""
        apply_update(self.directions, [(p, p.tensor) for p in self.params], step, coefficients, lr, weight_decay)
