"""Host memory a loaded checkpoint leaves behind: the pages of its mapped files once the weights they
hold were copied elsewhere, and the heap that transforming them (quantization) freed.

transformers maps each safetensors shard of a checkpoint into memory (a private file mapping) and
hands out tensors that view it. Reading such a tensor brings its pages into the process's resident
set, and they stay there for as long as any tensor views that shard, although nothing reads them
again once an offloaded block's weights sit in their host master (or a layer's weights were
quantized). Building the host masters of a 679 MiB float16 checkpoint peaked at 1.40x its bytes that
way, 1.12x with the pages given back (tests/e2e/test_load_peak.py).
`MappedFiles.release` drops the whole pages inside a tensor's bytes (`madvise(MADV_DONTNEED)`): the
mapping is private and read-only in practice, so a page read again would come back from the file,
unchanged. Only pages of a `.safetensors` file mapping are ever released, never anonymous memory,
whose pages DONTNEED would zero. Linux only; elsewhere (or without libc) it does nothing.

`trim_heap` returns freed heap to the system (glibc's `malloc_trim`): after a layer's temporaries are
freed, glibc keeps them for reuse, and with the next layer's allocations landing beside them the heap
only grows (quantizing a 390 MiB base layer by layer peaked 600 MiB above its end without it).
"""

from __future__ import annotations

import ctypes
import functools
import mmap

import torch

MADV_DONTNEED = 4


class MappedFiles:
    """The checkpoint mappings of this process, read from /proc/self/maps when made (make it after
    the model has loaded)."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []
        self._madvise = None
        try:
            with open("/proc/self/maps", encoding="utf-8") as fh:
                for line in fh:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[1].endswith("p") and parts[5].strip().endswith(".safetensors"):
                        lo, hi = (int(x, 16) for x in parts[0].split("-"))
                        self.ranges.append((lo, hi))
            if self.ranges:
                self._madvise = _libc().madvise
        except (OSError, AttributeError):
            self.ranges = []

    def release(self, t: torch.Tensor) -> int:
        """Drop the whole pages inside `t`'s bytes if `t` views a checkpoint mapping (call it once
        nothing will read `t` again); the bytes given back (0 when `t` is other memory)."""
        if self._madvise is None or t.device.type != "cpu" or not t.is_contiguous():
            return 0
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        if not any(lo <= start and end <= hi for lo, hi in self.ranges):
            return 0
        page = mmap.PAGESIZE
        lo, hi = -(-start // page) * page, end // page * page  # whole pages only: neighbours keep theirs
        if hi <= lo:
            return 0
        return hi - lo if self._madvise(lo, hi - lo, MADV_DONTNEED) == 0 else 0  # refused: the pages stay


@functools.cache
def _libc() -> ctypes.CDLL:
    """glibc, opened once (quantization trims the heap after every layer); OSError where there is none."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def trim_heap() -> None:
    """Give freed heap back to the system (glibc's malloc_trim; nothing elsewhere)."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the allocator keeps what it keeps
