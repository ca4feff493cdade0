"""Ports for processes a test starts that bind them by number (a torchrun rendezvous, SLURM's daemons)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_GIVEN: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range and not handed out before in this process.
    A port from bind(0) is in that range, where any process's next bind(0) (the other test worker's
    stores and servers) may take it before the test's process binds it by number; below it only a
    bind by number can. torch's and slurm/train.sbatch's rendezvous ports (29400-30399) are avoided."""
    rng, high = random.Random(), min(_ephemeral_low(), 32768)
    for _ in range(200) if high > 20000 else ():
        port = rng.randrange(20000, high)
        if port in _GIVEN or 29400 <= port < 30400:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    with socket.socket() as s:  # no room below the ephemeral range: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
