"""Helpers that start real multi-process jobs: torchrun for whole runs, torch.multiprocessing for
collective-level checks. Every process uses the gloo backend on CPU."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N -m distzo train ARGS` (plain python for N=1)."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "distzo", "train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "distzo", "train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=cwd, timeout=timeout)


def spawn_env(rank: int, world: int, port: int) -> None:
    os.environ.update(ENV)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
