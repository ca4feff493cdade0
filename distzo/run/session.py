"""What every run starts with, set up one way for training, evaluation and the benchmark: the thread
count, the mesh of the launched processes, the run directory (claimed by rank 0 and shared with every
rank), its log file and saved configuration when no Hydra app has set them up, and the run seed.

The command line runs inside Hydra, which creates the directory, writes `.hydra/` and configures the
log before the run starts; a run started from Python (or a notebook) gets the same files from here.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ..config.compose import saved_form
from ..config.schema import Config
from ..errors import ConfigError, DistzoError
from ..parallel.launch_env import launched_local_rank, launched_local_world_size
from ..parallel.mesh import Mesh
from .rundir import RunDirectory

log = logging.getLogger("distzo")

_DEFAULT_THREADS = torch.get_num_threads()  # torch's own default, before any run changes it


OVERSUBSCRIBED = 4  # threads beyond this many per CPU are refused


def _threads(threads: int | None) -> int:
    """The run's torch CPU threads: `threads`. torch takes any count, and its first parallel region then
    starts that many threads: a count far beyond the CPUs this process may run on exhausts memory (a
    MemoryError or a crash) and is refused; one beyond them only slows the work, with a warning, once
    a node (by its first rank). Ranks not bound to CPUs of their own share the node's: there, the
    threads of all the node's ranks together are what must fit."""
    if threads is None:
        return _DEFAULT_THREADS
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads > OVERSUBSCRIBED * cpus:
        raise ConfigError(f"threads={threads} is more than {OVERSUBSCRIBED} times the {cpus} CPUs this process may "
                          f"use; set threads to at most {cpus}, or leave it unset for torch's default")
    if launched_local_rank() != 0:
        return threads
    ranks = launched_local_world_size()
    if threads > cpus:
        log.warning("threads=%d is more than the %d CPUs this process may use, which slows the work; set threads "
                    "to at most %d", threads, cpus, cpus)
    elif threads * ranks > cpus and cpus == os.cpu_count():  # unbound: the node's ranks share its CPUs
        log.warning("threads=%d on each of this node's %d ranks is %d threads on its %d CPUs, which slows the work; "
                    "set threads to at most %d", threads, ranks, threads * ranks, cpus, max(1, cpus // ranks))
    return threads


def under_hydra() -> bool:
    """Whether this process runs inside a Hydra app (the command line), which owns the log and `.hydra/`."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.initialized()


def _run_dir_setting() -> str:
    """The setting that names the run directory, for its errors: Hydra's (a sweep's jobs are
    `hydra.sweep.dir`'s subfolders) or the library's `run_dir`."""
    if not under_hydra():
        return "run_dir"
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return "hydra.sweep.dir" if HydraConfig.get().mode == RunMode.MULTIRUN else "hydra.run.dir"


class Session:
    """A run's mesh and directory (see the module docstring). Collective: every rank constructs it
    with the same configuration. run_dir: a claimed RunDirectory (the command line claims it before
    Hydra writes), a path, or None (outputs/<date>/<time>); rank 0's is every rank's. continuing:
    the run continues from a snapshot named by path; resumable=False: the command continues no run
    (see RunDirectory.claim)."""

    def __init__(self, cfg: Config, run_dir: RunDirectory | str | Path | None = None, continuing: bool = False,
                 resumable: bool = True):
        self.continuing, self.resumable = continuing, resumable
        self.cfg = cfg
        self._handlers: list[logging.Handler] = []
        try:
            torch.set_num_threads(_threads(cfg.threads))  # set (or restored) per run: a sweep runs several
            self.mesh = Mesh.create(cfg.mesh, str(cfg.device), cfg.dist_timeout_s)
        except DistzoError:
            if isinstance(run_dir, RunDirectory):  # handed over by the command line, which created it
                run_dir.remove_if_unused()
            raise
        try:
            self.directory = self._claim(run_dir)
            self.run_dir = self.directory.path
            if self.mesh.is_main:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                if not under_hydra():
                    self._log_to_run_dir()
                    self._save_config()
            elif under_hydra():
                self._leave_the_log_to_rank_0()
        except BaseException:
            self.close()
            raise

    def _claim(self, run_dir: RunDirectory | str | Path | None) -> RunDirectory:
        """Rank 0 claims the directory and tells every rank which it is, or what is wrong with it
        (so every rank fails with the same line instead of waiting for rank 0)."""
        key = _run_dir_setting()
        return self.mesh.decided_on_main(lambda: run_dir if isinstance(run_dir, RunDirectory) else RunDirectory.claim(
            self.cfg, run_dir, key=key, continuing=self.continuing, resumable=self.resumable))

    def _log_to_run_dir(self) -> None:
        """The run's log in <run_dir>/train.log, and on the console when nothing else prints it."""
        fmt = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s")
        handler = logging.FileHandler(self.run_dir / "train.log")
        handler.setFormatter(fmt)
        self._handlers.append(handler)
        if not logging.getLogger().handlers and not log.handlers:
            console = logging.StreamHandler(sys.stdout)
            console.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
            self._handlers.append(console)
        for h in self._handlers:
            log.addHandler(h)
        if log.level == logging.NOTSET or log.level > logging.INFO:
            log.setLevel(logging.INFO)

    @staticmethod
    def _leave_the_log_to_rank_0() -> None:
        """Launchers that run the Hydra job on every rank (submitit's tasks) give each a handler on the
        run's train.log; only rank 0 writes the run directory, so the others drop theirs."""
        root = logging.getLogger()
        for handler in list(root.handlers):
            if isinstance(handler, logging.FileHandler):
                root.removeHandler(handler)
                handler.close()

    def _save_config(self) -> None:
        """<run_dir>/.hydra/config.yaml, as the command line's runs have it (`eval.run` and `replay`
        read it)."""
        folder = self.run_dir / ".hydra"
        folder.mkdir(exist_ok=True)
        (folder / "config.yaml").write_text(OmegaConf.to_yaml(saved_form(self.cfg)))

    def seed(self, fixed: int | None = None) -> int:
        """The run seed every direction derives from: `fixed` (a resumed run's), the configured one,
        or one rank 0 draws; every rank receives rank 0's."""
        if fixed is not None:
            return int(fixed)
        return int(self.mesh.broadcast_object(self.cfg.seed if self.cfg.seed is not None else secrets.randbits(63)))

    def close(self) -> None:
        for h in self._handlers:
            log.removeHandler(h)
            h.close()
        self._handlers.clear()
        self.mesh.close()
