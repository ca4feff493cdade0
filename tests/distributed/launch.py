"""Helpers that start real multi-process jobs: whole runs with torchrun's worker environment,
functions per rank (as torch.multiprocessing runs them) for collective-level checks. Every process
uses the gloo backend on CPU.

Importing torch and transformers costs a process about 6 s of CPU, which on the 2-core CI machine
dominated the suite when every rank of every run paid it. `torchrun()` therefore forks each run's
ranks from a forkserver that imported distzo, torch and transformers once (and composed and checked
one configuration, `warm_server`, for what a process pays at its first), and gives them the
environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, ..., TORCHELASTIC_*), and hosts
the job's TCP store itself as torchrun's agent does (`TORCHELASTIC_USE_AGENT_STORE=True`). Like
torchrun, it stops the other ranks once one has failed. `start_ranks()` forks the ranks of
collective-level checks from the same server. Tests of torchrun's own behaviour (its agent store,
`--max-restarts`, its error reporting) build and run the real `torchrun` command line themselves.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def hosted_store(world: int, timeout_s: float):
    """A TCP store for `world` ranks, hosted here as torchrun's agent hosts one, on a port the OS
    assigns as it binds (no window in which another process of the suite can take it). Ranks given
    TORCHELASTIC_USE_AGENT_STORE=True and MASTER_PORT=store.port join it as clients."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def torchrun_script(nproc: int, script: str | Path, *args: str, cwd: Path | None = None, timeout: float = 600,
                    env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The equivalent of `torchrun --standalone --nproc-per-node N SCRIPT ARGS` (a script of your
    own, such as a transformers Trainer script), its ranks forked from the preloaded server."""
    return run_forked(nproc, ["--script", str(script), *args], cwd=cwd, timeout=timeout, env=env)


def torchrun(nproc: int, *args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """The equivalent of `torchrun --standalone --nproc-per-node N -m distzo train ARGS` (plain python
    for N=1), its workers forked from the preloaded server (see the module docstring)."""
    return run_forked(nproc, ["train", *args], cwd=cwd, timeout=timeout)


def set_rank_env(rank: int, world: int, port: int, job: int = 0) -> None:
    """A rank's environment (start_ranks), torchrun's worker's: it joins the store the test process hosts
    on `port` (`hosted_store`) as a client, its keys under the namespace of `job` (parallel/mesh.py
    gives each attempt of a worker group one), so one store serves several runs in turn."""
    os.environ.update(ENV)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                      TORCHELASTIC_RESTART_COUNT=str(job))


# --- forked runs ------------------------------------------------------------------------------------

PRELOAD = ["distzo.__main__", "distzo.run.training", "distzo.run.bench", "distzo.run.replay", "distzo.run.checks",
           "transformers", "transformers.trainer", "distzo.hf.trainer",
           "transformers.models.llama.modeling_llama", "transformers.models.opt.modeling_opt",
           "transformers.models.qwen2.modeling_qwen2", "tests.distributed.warm_server"]
_server_lock = threading.Lock()
_context = None


def _forkserver():
    """The multiprocessing context whose server has imported PRELOAD (started once per session).
    The server starts with ENV (OMP_NUM_THREADS=1 among it): OpenMP reads it when torch loads."""
    global _context
    with _server_lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            saved = dict(os.environ)
            os.environ.update(ENV)
            try:
                multiprocessing.forkserver.ensure_running()
            finally:
                os.environ.clear()
                os.environ.update(saved)
            _context = ctx
    return _context


def _worker(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """One rank: torchrun's environment, its own stdout / stderr files, then `python -m distzo ARGV`."""
    os.environ.clear()
    os.environ.update(env)
    _reread_hub_settings()
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = ["distzo", *argv]
    code = 0
    try:
        if argv and argv[0] == "--script":  # a Python script of the user's, as `torchrun script.py ARGS` runs it
            import runpy

            sys.argv = argv[1:]
            runpy.run_path(argv[1], run_name="__main__")
        else:
            from distzo.cli.main import main

            main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _reread_hub_settings() -> None:
    """huggingface_hub reads its settings (HF_ENDPOINT, HF_HUB_OFFLINE, HF_HOME, ...) into
    `huggingface_hub.constants` when it is imported, which the preloaded server did with the suite's
    offline environment. Re-executing that module in place gives a forked rank the settings of its
    own environment, as a fresh process would have them (the library reads them as `constants.X`)."""
    import importlib

    import huggingface_hub.constants

    importlib.reload(huggingface_hub.constants)


def start_ranks(fn, nprocs: int, args: tuple) -> None:
    """`torch.multiprocessing.start_processes(fn, args, nprocs, join=True)` for collective-level
    checks, each rank forked from the preloaded server rather than spawned (a spawned rank pays the
    imports again). fn(rank, *args) must be importable by name (a module-level function of a test
    module); it sets its own environment (set_rank_env)."""
    import torch.multiprocessing as mp

    _forkserver()  # the server the forkserver context uses, started once with PRELOAD imported
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


class ForkedJob:
    """`python -m distzo ARGV` as nproc ranks of one standalone job, forked from the preloaded server
    and running in the background: `ranks` are their processes in rank order (a test may kill one, as
    it would kill a torchrun worker), `wait()` collects the job as `run_forked` returns it.
    env: variables to set for every rank, on top of the suite's environment (None: unset it)."""

    def __init__(self, nproc: int, argv: list[str], cwd: Path | None = None, timeout: float = 600,
                 env: dict[str, str] | None = None):
        import tempfile
        import uuid

        ctx = _forkserver()
        self.argv = argv
        cwd = str(cwd or os.getcwd())
        # As torchrun's agent does: host the job's store here, and tell the ranks to use it.
        self._store = hosted_store(nproc, timeout) if nproc > 1 else None
        port = self._store.port if self._store is not None else 0
        run_id = uuid.uuid4().hex[:12]
        self._logs = Path(tempfile.mkdtemp(prefix="distzo-ranks-"))
        self.ranks = []
        base = {k: v for k, v in {**ENV, **(env or {})}.items() if v is not None}
        for rank in range(nproc):
            rank_env = dict(base)
            if nproc > 1:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
                                ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                                TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                                TORCHELASTIC_RUN_ID=run_id)
            p = ctx.Process(target=_worker, args=(argv, rank_env, cwd, str(self._logs / f"{rank}.out"),
                                                  str(self._logs / f"{rank}.err")))
            p.start()
            self.ranks.append(p)

    def running(self) -> bool:
        """Every rank still runs (none has ended, whether it failed or finished)."""
        return all(p.exitcode is None for p in self.ranks)

    def wait(self, timeout: float = 600, grace_s: float = 30.0) -> subprocess.CompletedProcess:
        """The ranks' outputs concatenated in rank order and the first failing rank's exit code (0 when
        all succeed). As torchrun does, once one rank has failed the others get `grace_s` to end on
        their own (to report their own error line), then are killed."""
        deadline, failed_at = time.time() + timeout, None
        try:
            while any(p.exitcode is None for p in self.ranks):
                now = time.time()
                if failed_at is None and any(p.exitcode not in (None, 0) for p in self.ranks):
                    failed_at = now
                if now > deadline or (failed_at is not None and now > failed_at + grace_s):
                    break
                time.sleep(0.05)
        finally:
            for p in self.ranks:
                if p.exitcode is None:
                    p.kill()
                p.join()
        self._store = None
        timed_out = time.time() > deadline and failed_at is None
        codes = [p.exitcode for p in self.ranks]
        returncode = next((c for c in codes if c != 0), 0)
        if timed_out:
            raise subprocess.TimeoutExpired(["distzo", *self.argv], timeout)
        logs, nproc = self._logs, len(self.ranks)
        read = lambda name: "".join((logs / f"{r}.{name}").read_text(errors="replace")  # noqa: E731
                                    for r in range(nproc) if (logs / f"{r}.{name}").exists())
        stdout, stderr = read("out"), read("err")
        for f in logs.iterdir():
            f.unlink()
        logs.rmdir()
        # A killed rank has a negative exit code; report it the way a shell would.
        return subprocess.CompletedProcess(["distzo", *self.argv],
                                           returncode if returncode >= 0 else 128 - returncode, stdout, stderr)


def run_forked(nproc: int, argv: list[str], cwd: Path | None = None, timeout: float = 600,
               grace_s: float = 30.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m distzo ARGV` as nproc ranks of one standalone job, to its end (ForkedJob.wait)."""
    return ForkedJob(nproc, argv, cwd=cwd, timeout=timeout, env=env).wait(timeout, grace_s)
