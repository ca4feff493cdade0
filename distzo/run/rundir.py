"""A run's directory: claimed before anything is written into it, and removed again when the command
that created it fails before training starts.

A directory is claimed when it can be created and written, holds no other run (a training run's
metrics.jsonl, unless resuming; a benchmark's bench.json or an evaluation's eval.json, which nothing
resumes), and, when resuming, holds a run this configuration may continue. The command line claims
it before Hydra creates it and writes `.hydra/` (so a mistake leaves nothing behind); the library
claims it when a run starts. Both use `RunDirectory`.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..config.schema import Config
from ..errors import ConfigError
from ..state.resume import check_resumable

log = logging.getLogger("distzo")

# What a failed start may leave in a directory it created, and takes away again: Hydra's files.
STARTUP_FILES = {".hydra", "train.log"}
# The results `bench` and `eval` write into their directory: a run of its own, which one more command
# would overwrite, and which resume=auto does not continue.
RESULT_FILES = ("bench.json", "eval.json")


def default_run_dir() -> Path:
    """outputs/<date>/<time> under the current directory (Hydra's default, for runs started from Python)."""
    return Path("outputs") / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")


def writable_ancestor(path: Path, key: str) -> Path:
    """The nearest existing ancestor of `path` (itself, if it exists), checked to be a directory in
    which this process can create one: a real attempt, since permission bits do not tell for root,
    read-only mounts or /proc."""
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{key}={path} cannot be created: {probe} is not a directory; choose another {key}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".distzo-probe-", dir=probe))
    except OSError as exc:
        what = "written" if probe == path else "created"
        raise ConfigError(f"{key}={path} cannot be {what}: creating a directory in {probe} fails "
                          f"({exc.strerror or exc}); choose another {key}") from None
    return probe


@dataclass
class RunDirectory:
    """path: the run directory. created_from: the nearest directory above it that existed before
    this command, when this command creates `path` (None: it existed already, and is never removed)."""

    path: Path
    created_from: Path | None = None

    @classmethod
    def claim(cls, cfg: Config, path: str | os.PathLike | None, key: str = "hydra.run.dir", fixed: bool = True,
              continuing: bool = False, resumable: bool = True) -> RunDirectory:
        """Check that `path` can hold this run (see the module docstring); raises ConfigError.
        fixed=False: `path` is only the fixed part of a directory that will be named at run time
        (Hydra's timestamped default), which cannot hold a run yet. continuing: the run continues
        from a snapshot given by path (the library's `resume_from`), so the run it holds is this one's
        own earlier part, whose logs after that snapshot are cut off. resumable=False (eval, bench):
        the command continues no run, so a directory holding one is refused whatever `resume` says."""
        path = Path(path) if path is not None else default_run_dir()
        base = writable_ancestor(path, key)
        created_from = base.resolve() if not fixed or not path.exists() else None
        if fixed and not continuing:
            for name in RESULT_FILES:  # resume=auto continues neither: refused whatever it says
                if (path / name).exists():
                    raise ConfigError(f"{path} already holds a run ({name}); choose another {key}")
            if (path / "metrics.jsonl").exists() and (not resumable or cfg.resume != "auto"):
                continue_it = " or add resume=auto to continue it" if resumable else ""
                raise ConfigError(f"{path} already holds a run (metrics.jsonl); choose another {key}{continue_it}")
            if cfg.resume == "auto" and resumable:
                check_resumable(cfg, path)
        return cls(path, created_from)

    def remove_if_unused(self) -> None:
        """After an error before training started: the directory goes again, with the empty parents
        this command created, if it holds nothing but start-up files (Hydra's)."""
        path = self.path
        if self.created_from is None or not path.is_dir() or not set(os.listdir(path)) <= STARTUP_FILES:
            return
        for handler in list(logging.getLogger().handlers) + list(log.handlers):
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == path.resolve():
                handler.close()  # train.log's handler
        shutil.rmtree(path, ignore_errors=True)
        parent = path.resolve().parent
        while parent != self.created_from and self.created_from in parent.parents:
            try:
                parent.rmdir()  # only if empty
            except OSError:
                break
            parent = parent.parent
