"""Wall-clock timers by category (noise, perturb, update, wait, comm, transfer), for the `bench` command.

Disabled timers cost one attribute check. Enabled ones synchronise CUDA at each boundary so time is
charged to the phase that spent it (benchmark runs only; training never enables them).

On CPU, z is drawn inside the same parallel work items that apply updates and write working copies
(`engine/chunkpass.py`), so drawing has no wall-clock interval of its own. A `WorkClock` sums, over
the chunk threads, the time inside work items and the part of it spent drawing z; a phase's wall
time is then split between `noise` and the phase in that proportion.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch


class WorkClock:
    """Thread time spent in parallel work items (`busy`) and, within them, in drawing z (`draw`),
    summed over threads. Safe to add to from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.busy = 0.0
        self.draw = 0.0

    def add(self, busy: float = 0.0, draw: float = 0.0) -> None:
        with self._lock:
            self.busy += busy
            self.draw += draw

    def read(self) -> tuple[float, float]:
        with self._lock:
            return self.busy, self.draw


class Timers:
    """clock: the WorkClock of the step's Directions (CPU), whose draws are charged to `noise`."""

    def __init__(self, enabled: bool = False, device: torch.device | None = None, clock: WorkClock | None = None):
        self.enabled = enabled
        self.cuda = device is not None and device.type == "cuda"
        self.clock = clock
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
        busy0, draw0 = self.clock.read() if self.clock is not None else (0.0, 0.0)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
            share = 0.0
            if self.clock is not None:
                busy, draw = self.clock.read()
                if busy > busy0:
                    share = min(1.0, (draw - draw0) / (busy - busy0))
            self.totals["noise"] += wall * share
            self.totals[name] += wall * (1.0 - share)
            self._depth -= 1

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing is timed inside (no CUDA synchronisation either)."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    def take(self) -> dict[str, float]:
        """The totals since the last take, then reset."""
        out = dict(self.totals)
        self.totals.clear()
        return out


DISABLED = Timers(False)
