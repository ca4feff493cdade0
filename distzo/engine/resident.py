"""The resident engine: every weight lives on the compute device.

Everything is in the shared stage loop (`base.StagedEngine`): embedding-like tables perturbed by
rows, dense parameters by chunks with their working copies written in one pass, and each step's
update fused into the next step's perturbation.
"""

from __future__ import annotations

from .base import StagedEngine


class ResidentEngine(StagedEngine):
    pass
