"""distzo's cache directory (converted models, compiled kernels) and the lock its writers share."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def cache_dir() -> Path:
    """$DISTZO_CACHE, else $XDG_CACHE_HOME/distzo, else ~/.cache/distzo."""
    root = os.environ.get("DISTZO_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "distzo"


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created if missing): several ranks may build one cache entry at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
