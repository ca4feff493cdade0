"""Wall-clock timers by category (noise, perturb, update, comm, transfer), for the `bench` command.

Disabled timers cost one attribute check. Enabled ones synchronise CUDA at each boundary so time is
charged to the phase that spent it (benchmark runs only; training never enables them).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch


class Timers:
    def __init__(self, enabled: bool = False, device: torch.device | None = None):
        self.enabled = enabled
        self.cuda = device is not None and device.type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)
        self._depth = 0

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not self.enabled or self._depth:  # nested phases are charged to the outer one
            yield
            return
        self._depth += 1
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.totals[name] += time.perf_counter() - start
            self._depth -= 1

    def take(self) -> dict[str, float]:
        """The totals since the last take, then reset."""
        out = dict(self.totals)
        self.totals.clear()
        return out


DISABLED = Timers(False)
