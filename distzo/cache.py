"""distzo's cache directory (converted models, compiled kernels) and the lock its writers share."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import DistzoError


class CacheError(DistzoError):
    """distzo's cache directory cannot hold what it must (a file in its place, no permission)."""


def cache_dir() -> Path:
    """$DISTZO_CACHE, else $XDG_CACHE_HOME/distzo, else ~/.cache/distzo."""
    root = os.environ.get("DISTZO_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "distzo"


def _unusable(exc: OSError) -> CacheError:
    """The line for a cache directory that cannot be created or written, naming the setting that moves it."""
    root = cache_dir()
    setting = f"DISTZO_CACHE={os.environ['DISTZO_CACHE']}" if os.environ.get("DISTZO_CACHE") else f"the cache {root}"
    if root.exists() and not root.is_dir():
        return CacheError(f"{setting} is not a directory; set DISTZO_CACHE to a directory (distzo creates it if "
                          "missing)")
    detail = exc.strerror or str(exc)
    if exc.filename:
        detail += f": {exc.filename}"
    return CacheError(f"{setting} cannot be used ({detail}); set DISTZO_CACHE to a writable directory")


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created if missing): several ranks may build one cache entry at once."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "w")
    except OSError as exc:
        raise _unusable(exc) from None
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
