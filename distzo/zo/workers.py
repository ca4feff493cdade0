"""Where chunk work runs: a thread pool, per-thread scratch buffers and an optional work clock.

On CPU, independent chunks run on several threads (the fused kernels and torch's ops release the
GIL), each chunk's work on one core while it is in cache; on CUDA the kernels are asynchronous already and work
runs on the calling thread. This is execution machinery only: which z a chunk has is defined in
`distzo.zo.directions` and does not depend on it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

if TYPE_CHECKING:
    from ..telemetry.timing import WorkClock

CHUNK_NUMEL = 1 << 20  # the smallest scratch buffer (a chunk, distzo.zo.directions)


def _serial_worker() -> None:
    """Initialiser of the chunk threads: their torch ops run single-threaded. Otherwise each thread's
    first large op starts an OpenMP team of its own (intra-op threads are per calling thread), the
    teams oversubscribe the cores, and they keep spinning into the next forward. The calling
    thread's own intra-op threads are unaffected."""
    torch.set_num_threads(1)


class ChunkWorkers:
    """Runs work items over a thread pool on CPU (inline elsewhere), with per-thread scratch.

    clock: a WorkClock (`bench`) that sums the threads' time in work items."""

    def __init__(self, device: torch.device, threads: int | None = None, clock: WorkClock | None = None):
        self.device = device
        n = threads if threads is not None else torch.get_num_threads()
        self._pool = (ThreadPoolExecutor(max_workers=n, initializer=_serial_worker)
                      if device.type == "cpu" and n > 1 else None)
        self._local = threading.local()
        self.clock = clock

    def scratch(self, numel: int, slot: int = 0) -> torch.Tensor:
        """A float32 buffer of `numel` elements private to the calling thread, reused across calls
        (a fresh chunk-sized tensor per call would page-fault on every first touch). Different
        slots are different buffers, for callers that hold several chunks' z at once. On CUDA a
        buffer is private to the current stream too: kernels queued on the upload stream (sliced
        updates) and on the compute stream (perturbations) are not ordered against each other, so
        one buffer shared between them could be overwritten while still being read."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {}
        key = (slot, self.stream_key())
        buf = bufs.get(key)
        if buf is None or buf.numel() < numel:
            with torch.inference_mode(False):
                buf = bufs[key] = torch.empty(max(numel, CHUNK_NUMEL), dtype=torch.float32, device=self.device)
        return buf[:numel]

    def stream_key(self) -> int | None:
        """The stream kernels are queued on now (CUDA), or None (CPU: work runs when called)."""
        if self.device.type != "cuda":
            return None
        return torch.cuda.current_stream(self.device).cuda_stream

    def map(self, fn: Callable[[Any], None], items: Iterable[Any], cost: Callable[[Any], float] | None = None) -> None:
        """Run fn over work items, in parallel on CPU. fn must touch only its own item's memory.

        cost: an item's relative work. Items then start largest first: the pool's threads take
        items in submission order, so this is longest-processing-time scheduling. A block's chunks
        differ in size by up to 8x (attention vs MLP projections), and in submission order the last
        large chunk often runs alone while the other threads idle."""
        items = list(items)
        if self.clock is not None:
            fn = self._clocked(fn)
        if self._pool is None or len(items) < 2:
            for item in items:
                fn(item)
            return
        if cost is not None:
            items.sort(key=cost, reverse=True)  # stable: equal costs keep their order
        # Grad and inference modes are thread-local: carry the caller's into the workers.
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

        def run(item: Any) -> None:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                fn(item)

        for _ in self._pool.map(run, items):
            pass

    def _clocked(self, fn: Callable[[Any], None]) -> Callable[[Any], None]:
        clock = self.clock

        def timed(item: Any) -> None:
            started = time.perf_counter()
            try:
                fn(item)
            finally:
                clock.add(busy=time.perf_counter() - started)

        return timed

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
