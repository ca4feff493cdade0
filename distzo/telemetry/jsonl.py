"""JSON-lines files: append-only writers flushed per record, tolerant readers, atomic rewrites."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable


class JsonlWriter:
    """Appends one JSON object per line, flushed as written. A no-op when `path` is None (ranks
    other than 0 write nothing)."""

    def __init__(self, path: Path | None):
        self.path = path
        self._fh = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(path, "a", encoding="utf-8")

    def append(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            return
        self._fh.write(json.dumps(record, allow_nan=True) + "\n")
        self._fh.flush()

    def sync(self) -> None:
        if self._fh is not None:
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self.sync()
            self._fh.close()
            self._fh = None


def read_jsonl(path: Path | str) -> list[dict[str, Any]]:
    """Records of a JSON-lines file; a torn last line (a crash mid-write) ends the list."""
    if not Path(path).exists():
        return []
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                break
    return out


def atomic_rewrite(path: Path, records: Iterable[dict[str, Any]]) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, allow_nan=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def truncate_after(path: Path, step: int) -> None:
    """Keep the records of steps <= step, dropping summaries (a resumed run rewrites what came
    after its snapshot)."""
    if Path(path).exists():
        atomic_rewrite(path, [r for r in read_jsonl(path) if r.get("type") != "summary" and r.get("step", 0) <= step])
