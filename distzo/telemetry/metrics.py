"""Run outputs: `metrics.jsonl` (one JSON object per line, flushed as written) and console progress."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Sequence

from .jsonl import JsonlWriter

log = logging.getLogger("distzo")


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since start or the last reset_peak_memory (Linux
    VmHWM; ru_maxrss where /proc is unavailable)."""
    peak = _status_kib("VmHWM")
    if peak is not None:
        return peak
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def host_memory_bytes() -> dict[str, int | None]:
    """This process's host memory: `peak` (the high-water mark since it started or since the last
    reset_host_peak / reset_peak_memory on CPU, which clear ru_maxrss too: read it before one) and
    `now` (VmRSS)."""
    return {"peak": peak_rss_bytes(), "now": _status_kib("VmRSS")}


def reset_host_peak() -> None:
    """Start a new high-water mark (Linux: 5 written to /proc/self/clear_refs resets VmHWM and
    ru_maxrss alike)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError:
        pass


def peak_memory_bytes(device) -> int:
    """Peak memory of the compute device: on CUDA what the caching allocator reserved at most (what
    the device really had to hold: allocated tensors plus the allocator's cached blocks, which is what
    runs out), or the process's peak RSS on CPU."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return int(max(torch.cuda.max_memory_reserved(device), torch.cuda.max_memory_allocated(device)))
    return peak_rss_bytes()


def reset_peak_memory(device) -> None:
    """Start a new peak: CUDA's allocator statistics, or the process's RSS high-water mark (Linux
    resets VmHWM when 5 is written to /proc/self/clear_refs)."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    reset_host_peak()


class MetricsWriter:
    """<run_dir>/metrics.jsonl: one record per line with a `type` and the run's static fields (its
    mesh), each also forwarded to `sinks` (e.g. wandb, see sinks.py). A no-op when `path` is None
    and there are no sinks (ranks other than 0)."""

    def __init__(self, path: Path | None, static: dict[str, Any] | None = None, sinks: Sequence[Any] = ()):
        self._out = JsonlWriter(path)
        self.static = dict(static or {})
        self.sinks = list(sinks)

    def write(self, kind: str, **fields: Any) -> None:
        record = {"type": kind, **fields, **self.static, "time": round(time.time(), 3)}
        self._out.append(record)
        for sink in self.sinks:
            sink.write(record)

    def sync(self) -> None:
        """On disk (fsync): what a snapshot written next relies on (keep_best's evaluation line)."""
        self._out.sync()

    def close(self) -> None:
        self._out.close()
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Progress:
    """Throttled progress lines for long loops: at most one line every `every_s` seconds, plus the last.

    The ETA is the pace of the items after the first one reported: the first carries the start-up
    (a training run's first step includes compiling kernels, warming caches and whatever ran before
    the loop, such as the zero-shot evaluation), so counting it would promise an hour for a
    nine-minute run. Until a second item is reported, the caller's own measure of an item
    (`pace_s`) stands in for it."""

    def __init__(self, label: str, total: int, every_s: float = 10.0, enabled: bool = True):
        self.label, self.total, self.every_s, self.enabled = label, total, every_s, enabled
        self.start = self._last = time.time()
        self._first: tuple[int, float] | None = None  # (done, time) at the first update

    def eta(self, done: int, now: float, pace_s: float | None = None) -> float:
        """Seconds left at `done`: the pace since the first update; with only that one, `pace_s`
        (seconds an item took, as the caller measured it) or else the pace overall."""
        if self._first is None or done <= self._first[0]:
            if pace_s is not None:
                return pace_s * (self.total - done)
            return (now - self.start) / done * (self.total - done) if done else float("inf")
        first_done, first_time = self._first
        return (now - first_time) / (done - first_done) * (self.total - done)

    def update(self, done: int, extra: str = "", force: bool = False, pace_s: float | None = None) -> None:
        if not self.enabled:
            return
        now = time.time()
        if self._first is None:
            self._first = (done, now)
        if not force and done < self.total and now - self._last < self.every_s:
            return
        self._last = now
        elapsed = now - self.start
        eta = self.eta(done, now, pace_s)
        log.info("%s %d/%d (%s elapsed, ETA %s)%s", self.label, done, self.total,
                 format_duration(elapsed), format_duration(eta), f" {extra}" if extra else "")
