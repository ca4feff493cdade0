"""Run outputs: `metrics.jsonl` (one JSON object per line, flushed as written) and console progress."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("distzo")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports ru_maxrss in KiB)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MetricsWriter:
    """Appends JSON lines to <run_dir>/metrics.jsonl. A no-op when `path` is None (non-zero ranks)."""

    def __init__(self, path: Path | None, static: dict[str, Any] | None = None):
        self.path = path
        self.static = dict(static or {})
        self._fh = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(path, "a", encoding="utf-8")

    def write(self, kind: str, **fields: Any) -> None:
        if self._fh is None:
            return
        record = {"type": kind, **fields, **self.static, "time": round(time.time(), 3)}
        self._fh.write(json.dumps(record, allow_nan=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Progress:
    """Throttled progress lines for long loops: at most one line every `every_s` seconds, plus the last."""

    def __init__(self, label: str, total: int, every_s: float = 10.0, enabled: bool = True):
        self.label, self.total, self.every_s, self.enabled = label, total, every_s, enabled
        self.start = self._last = time.time()

    def update(self, done: int, extra: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.time()
        if not force and done < self.total and now - self._last < self.every_s:
            return
        self._last = now
        elapsed = now - self.start
        eta = elapsed / done * (self.total - done) if done else float("inf")
        log.info("%s %d/%d (%s elapsed, ETA %s)%s", self.label, done, self.total,
                 format_duration(elapsed), format_duration(eta), f" {extra}" if extra else "")
