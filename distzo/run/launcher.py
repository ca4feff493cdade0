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

from ..errors import DistzoError


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


def start_local_workers(nproc: int, argv: Sequence[str], launch: Any) -> None:
    """Run `python -m distzo ARGV` as `nproc` local workers (see the module docstring) and wait for
    them. launch: the `launch` settings (rendezvous endpoint, restarts, stop timeout). Raises
    WorkerFailed with the first failure's exit status; a worker that printed its own error line
    (exit status 2, every worker's input check) gets no second line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .signals import EXIT_STOPPED

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    endpoint = launch.rdzv_endpoint or "127.0.0.1:0"  # port 0: a free one (torchrun --standalone)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"distzo-{uuid.uuid4().hex[:8]}",
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
        rank, failure = min(exc.failures.items(), key=lambda kv: kv[1].timestamp)
        code = failure.exitcode
        if code == 2:  # an input error: every worker has printed its own line
            raise WorkerFailed("", 2) from None
        what = f"was killed by {_signal_name(code)}" if code < 0 else f"exited with status {code}"
        raise WorkerFailed(f"local worker {rank} of {nproc} {what}, so the job stopped (its output, if any, is "
                           "above); continue it with resume=auto and the same hydra.run.dir",
                           128 - code if code < 0 else code) from None
