"""Working copies built beside the forward: block i + 1's update and copies on a second CUDA stream
while the forward runs through block i (`engine.copy_stream`).

On a GPU the chunk kernel that applies a block's pending update and writes its working copies is
arithmetic-bound (two Gaussian draws an element), and in one stream it runs between the blocks'
forwards, adding its whole time to the step. Here a resident walk runs its forward on a
high-priority compute stream and builds each block's copies one block ahead on the copy stream, at
the lowest priority: the GPU's scheduler hands the copy kernel's programs the room the forward's
kernels leave (a matrix product's last partial wave, the memory-bound norms and activations, the
gaps between launches) before any forward program that is waiting (priorities order the programs not
yet started; a copy program already running is not preempted).

Ordering, by events on the device (the host never waits):
- the copy stream starts block i + 1's pass once the compute stream's work queued so far is done
  (up to block i - 1's forward, the last reader of the buffer slot that block i + 1 writes: blocks
  alternate between two slots of working copies, `SideStreamNoise`);
- the compute stream waits for that pass before block i + 1's forward reads the copies;
- the caller's stream and the compute stream wait for each other at a walk's ends, and the walk's
  scores are marked as used on the caller's stream for the allocator.
The values are those of the one-stream walk, bitwise: the same kernels on the same inputs.

On a CPU there is no second stream: the look-ahead and the two slots run in order, which is how the
CPU suite checks them against the one-stream walk.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch

from ..zo.params import TrainableParam
from .weights import StageNoise

# The compute stream's priority: CUDA maps any lower number to the device's highest priority. The copy
# stream keeps the default priority, the lowest.
HIGHEST = -100
SLOTS = 2  # block i's copies and block i + 1's, in flight together


class CopyStreams:
    """The compute stream and the copy stream of a resident walk (on a CPU: neither)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.Stream(device, priority=HIGHEST)
            self.copies = torch.cuda.Stream(device)

    @contextmanager
    def walk(self) -> Iterator[Callable[[torch.Tensor], None]]:
        """The walk's forward on the compute stream, ordered after the caller's stream and before
        its later work; yields `keep`, which marks a tensor the walk returns as used by the caller's
        stream (so the allocator does not hand its memory to the compute stream early)."""
        if not self.cuda:
            yield lambda t: None
            return
        caller = torch.cuda.current_stream(self.device)
        self.compute.wait_stream(caller)
        try:
            with torch.cuda.stream(self.compute):
                yield lambda t: t.record_stream(caller)
        finally:
            caller.wait_stream(self.compute)
            caller.wait_stream(self.copies)  # nothing of the walk is left running where the caller looks

    def build(self, queue: Callable[[], None]) -> torch.cuda.Event | None:
        """Run `queue` (which launches kernels) on the copy stream once the current stream's queued
        work is done; returns the event of its end (None on a CPU, where it ran in order)."""
        if not self.cuda:
            queue()
            return None
        self.copies.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copies):
            queue()
        done = torch.cuda.Event()
        done.record(self.copies)
        return done

    def wait(self, done: torch.cuda.Event | None) -> None:
        """The current stream waits for a `build`'s end."""
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)


class SideStreamNoise(StageNoise):
    """A block's working copies built on the copy stream, in buffer slot `slot` (blocks alternate
    between `SLOTS` of them, so block i + 1's copies are written while block i's are read); `ready`
    makes the current stream wait for them."""

    def __init__(self, *args, streams: CopyStreams, slot: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.streams, self.buffer = streams, f"ahead{slot}-"
        self._built: torch.cuda.Event | None = None

    def _build(self, passes: Callable[[], None]) -> None:
        # The copies' buffers were carved on the current stream (the compute stream's memory): only
        # the kernels run on the copy stream.
        self._built = self.streams.build(passes)

    def ready(self) -> None:
        self.streams.wait(self._built)
        self._built = None

    def copies(self, entries: Sequence[TrainableParam], index: int,
               source: Callable[[TrainableParam], torch.Tensor]) -> dict[str, torch.Tensor]:
        out = super().copies(entries, index, source)
        self.ready()  # copies built on first use went to the copy stream too
        return out
