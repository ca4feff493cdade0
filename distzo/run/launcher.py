"""Starting a mesh's local workers from one plain process, as torchrun would: `python -m distzo train
mesh=2x2` runs `python -m distzo train mesh=2x2` as 4 workers under torch's elastic agent (the
launcher torchrun itself uses), with the same rendezvous, worker environment and failure handling:
a worker that fails ends the job, Ctrl-C and SIGTERM reach every worker (which stop after the step
in flight with a snapshot, as under torchrun), and the job's exit status is the first failure's.

torchrun sets OMP_NUM_THREADS=1 for its workers unless it is set, so that N workers do not each
start a thread per core; the self-launch does the same, so both runs compute with the same threads
(and the same results)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import uuid
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from ..config.schema import LaunchConfig
from ..errors import ConfigError, DistzoError


class WorkerFailed(DistzoError):
    """A local worker failed; `exit_code` is the job's exit status."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def check_local_devices(nproc: int, mesh: str, device: str) -> None:
    """Local workers on CUDA take one GPU each: this machine must show `nproc` of them."""
    from ..parallel.mesh import device_type

    if device_type(device) == "cuda":
        import torch

        if nproc > torch.cuda.device_count():
            raise DistzoError(f"mesh={mesh} needs {nproc} processes, one per GPU, but this machine shows "
                              f"{torch.cuda.device_count()} GPUs; use a mesh of at most {torch.cuda.device_count()} "
                              "processes here, or launch across nodes (torchrun, srun; docs/cluster.md)")


def run_local_workers(command: str, args: Sequence[str], cfg: DictConfig) -> bool:
    """A plain process's command whose mesh needs several processes: run it as that many local
    workers (`start_local_workers`) and wait for them; False when one process runs it. `cfg`: the
    command's composed configuration (with its `hydra` section). The run directory is fixed here,
    once, so that workers restarted after a failure (launch.max_restarts) find the run again and
    continue it (distzo.cli.hydra_app: a restarted group resumes)."""
    from ..parallel.shape import MeshShape

    needed = MeshShape.parse(cfg.mesh).size
    nproc = cfg.launch.nproc or needed
    if command != "eval" and nproc != needed:
        raise DistzoError(f"launch.nproc={nproc} does not fit mesh={cfg.mesh}, which needs {needed} processes; leave "
                          f"launch.nproc unset (it starts what the mesh needs) or use a mesh of {nproc} processes")
    if nproc <= 1:
        return False
    check_local_devices(nproc, str(cfg.mesh), str(cfg.device))
    from ..config.compose import override_key, upgrade_overrides

    raw = str(OmegaConf.to_container(cfg.hydra.run, resolve=False)["dir"]) if "hydra" in cfg else ""
    if str(cfg.resume) == "auto" and timestamped(raw):
        raise ConfigError("resume=auto needs a fixed run directory that a restarted job finds again: add "
                          "hydra.run.dir=/path/to/run")
    # The workers read today's spelling (the old one's note was printed here, once) and one run directory.
    flags = [a for a in args if a.startswith("-")]
    overrides = upgrade_overrides([a for a in args if not a.startswith("-")])
    run_dir = resolved_run_dir(cfg) if not any(override_key(o) == "hydra.run.dir" for o in overrides) else None
    start_local_workers(nproc, [command, *flags, *overrides, *([f"hydra.run.dir={run_dir}"] if run_dir else [])],
                        cfg.launch)
    return True


def timestamped(run_dir: str) -> bool:
    """Whether a run directory's setting names a new directory at every start (Hydra's `${now:...}`)."""
    return "${now:" in run_dir


def restart_overrides(overrides: list[str]) -> list[str]:
    """A worker group that the elastic agent restarted after a failure (torchrun --max-restarts,
    launch.max_restarts) continues the run its first start began: resume=auto, in the same run
    directory (the self-launch fixes it; under torchrun the command line must name one that is not
    timestamped). An explicit resume= is kept; a first start's overrides pass unchanged."""
    from ..config.compose import override_key

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart == 0 or any(override_key(o) == "resume" for o in overrides):
        return overrides
    say = logging.getLogger("distzo").warning if os.environ.get("RANK", "0") == "0" else (lambda *a: None)
    run_dir = [o.split("=", 1)[1] for o in overrides if override_key(o) == "hydra.run.dir"]
    if not run_dir or timestamped(run_dir[-1]):
        say("restart %d of the worker group: hydra.run.dir is timestamped, so this restart starts a new run; give a "
            "fixed hydra.run.dir to have restarts continue the run", restart)
        return overrides
    say("restart %d of the worker group: continuing the run from its newest snapshot and logged steps (resume=auto)",
        restart)
    return [*overrides, "resume=auto"]


def resolved_run_dir(cfg: DictConfig) -> str | None:
    """The run directory Hydra would name now (its `${now:...}` and other interpolations resolved
    once), for every worker and every restart of them; None where it cannot be resolved outside
    Hydra's app (each worker then resolves it itself)."""
    from hydra.core.utils import setup_globals

    if "hydra" not in cfg:
        return None
    setup_globals()  # Hydra's resolvers (${now:...}), as inside its app
    try:
        return str(OmegaConf.select(cfg, "hydra.run.dir"))
    except Exception:  # an interpolation that needs Hydra's runtime
        return None


def root_failure(failures: dict) -> tuple[int, Any]:
    """The (rank, failure) that caused a worker group to fail: the first. Timestamps are whole
    seconds (no worker writes an error file), so one poll of the agent often sees several at once: a
    worker killed by a signal the agent did not send, a peer that then lost it and exited 1, and the
    workers the agent then stopped with SIGTERM. The cause is the killed one, else one that exited
    with an error, and only then one stopped by SIGTERM; among equals, the lowest rank."""
    def order(kv) -> tuple[int, int, int]:
        code = kv[1].exitcode
        kind = 0 if code < 0 and code != -signal.SIGTERM else 2 if code == -signal.SIGTERM else 1
        return kv[1].timestamp, kind, kv[0]

    return min(failures.items(), key=order)


def start_local_workers(nproc: int, argv: Sequence[str], launch: LaunchConfig) -> None:
    """Run `python -m distzo ARGV` as `nproc` local workers (see the module docstring) and wait for
    them. launch: the `launch` settings (rendezvous endpoint, restarts, stop timeout). Raises
    WorkerFailed with the first failure's exit status; a worker that printed its own error line
    (exit status 2, every worker's input check) gets no second line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig as ElasticConfig
    from torch.distributed.launcher.api import elastic_launch

    from .signals import EXIT_STOPPED

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    endpoint = launch.rdzv_endpoint or "127.0.0.1:0"  # port 0: a free one (torchrun --standalone)
    config = ElasticConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"distzo-{uuid.uuid4().hex[:8]}",
                           rdzv_backend="c10d", rdzv_endpoint=endpoint, rdzv_configs={"is_host": True},
                           max_restarts=launch.max_restarts, monitor_interval=0.2, start_method="spawn",
                           shutdown_timeout=int(launch.stop_timeout_s))
    # The agent's own chatter (rendezvous, worker groups) stays out of the run's output; its
    # warnings (a worker failed, workers being stopped) remain.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    print(f"[{time.strftime('%H:%M:%S')}] Starting {nproc} local workers (torch's elastic agent, as torchrun "
          "--standalone would)", flush=True)
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "distzo", *argv)
    except SignalException:  # Ctrl-C or SIGTERM here: the agent passed it on, the workers stopped with a snapshot
        raise WorkerFailed("", EXIT_STOPPED) from None
    except ChildFailedError as exc:
        rank, failure = root_failure(exc.failures)
        code = failure.exitcode
        if code == 2:  # an input error: every worker has printed its own line
            raise WorkerFailed("", 2) from None
        what = f"was killed by {_signal_name(code)}" if code < 0 else f"exited with status {code}"
        raise WorkerFailed(f"local worker {rank} of {nproc} {what}, so the job stopped (its output, if any, is "
                           "above); continue it with resume=auto and the same hydra.run.dir",
                           128 - code if code < 0 else code) from None
