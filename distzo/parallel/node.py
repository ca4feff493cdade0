"""The node: the ranks of one torchrun agent (one machine), and host memory they share.

torchrun gives every agent a contiguous range of global ranks (`GROUP_RANK` numbers the agent,
`LOCAL_RANK` / `LOCAL_WORLD_SIZE` the process within it), so the node of global rank r is
r // LOCAL_WORLD_SIZE. Every rank holds the same weights (I1, docs/architecture.md#invariants), so a
node needs only one copy of what it keeps in host memory: `Node.shared_tensor` maps one buffer into
every local rank.

Shared buffers are files in /dev/shm, created by local rank 0, mapped by every local rank, then
unlinked as soon as all have mapped them. From then on the memory has no name: it is freed when the
last process unmaps it (exit, crash or SIGKILL alike), so no segment can outlive the job. The only
window for a leak is a local rank 0 killed between creating and unlinking a file; every later
creation sweeps files whose creator is no longer alive.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DistzoError

log = logging.getLogger(__name__)

PREFIX = "distzo-"


def shm_dir() -> Path:
    """Where shared buffers are created: /dev/shm (RAM-backed) when present, else the temp dir."""
    override = os.environ.get("DISTZO_SHM_DIR")
    if override:
        return Path(override)
    if Path("/dev/shm").is_dir():
        return Path("/dev/shm")
    import tempfile

    return Path(tempfile.gettempdir())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_stale_segments(directory: Path | None = None) -> list[Path]:
    """Remove shared buffers whose creating process has died (a crash between create and unlink)."""
    directory = directory or shm_dir()
    removed = []
    for path in directory.glob(f"{PREFIX}*"):
        try:
            pid = int(path.name[len(PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if not _alive(pid):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed


class Node:
    """This process's local rank, the node's size and (for more than one local rank) process groups
    over the node's ranks: `group` (gloo) for host-side barriers and small broadcasts, and
    `device_group` for collectives on device tensors (NCCL on CUDA, the gloo group on CPU)."""

    def __init__(self, local_rank: int = 0, size: int = 1, group: Any = None, index: int = 0,
                 device_group: Any = None):
        self.local_rank, self.size, self.group, self.index = local_rank, size, group, index
        self.device_group = device_group if device_group is not None else group

    @classmethod
    def single(cls) -> Node:
        return cls()

    @classmethod
    def create(cls, device_backend: str, timeout: datetime.timedelta) -> Node:
        """Build the node groups of an initialised default group (every rank must call this, in the
        same order, since creating groups is collective)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if size < 1 or world % size:
            size = 1  # not launched per node (e.g. a hand-made world): every rank is its own node
        if size == 1:
            return cls(0, 1, None, rank)
        groups = [list(range(start, start + size)) for start in range(0, world, size)]
        host, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo", timeout=timeout)
        device = host
        if device_backend != "gloo":
            device, _ = dist.new_subgroups_by_enumeration(groups, backend=device_backend, timeout=timeout)
        return cls(rank % size, size, host, rank // size, device)

    def groups(self) -> list[Any]:
        """The process groups this node made (none for a node of one rank)."""
        return list({id(g): g for g in (self.group, self.device_group) if g is not None}.values())

    @property
    def shared(self) -> bool:
        return self.size > 1

    def barrier(self) -> None:
        """Every local rank has reached this point (and its writes to shared memory are visible)."""
        if self.group is not None:
            t = torch.zeros(1)
            dist.all_reduce(t, group=self.group)

    def all_sum(self, values: list[float]) -> list[float]:
        """Sum float64 values over the node's ranks (e.g. bytes each moved this step)."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(t, group=self.group)
        return t.tolist()

    def broadcast_object(self, obj: Any) -> Any:
        """Local rank 0's object on every local rank."""
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def shared_tensor(self, numel: int, dtype: torch.dtype, tag: str) -> torch.Tensor:
        """A flat tensor of `numel` elements in host memory that every local rank maps (contents
        undefined until written). With one local rank, an ordinary tensor."""
        if not self.shared:
            return torch.empty(numel, dtype=dtype)
        path, problem = None, None
        if self.local_rank == 0:
            directory = shm_dir()
            for stale in sweep_stale_segments(directory):
                log.warning("Removed a shared-memory segment left by a dead process: %s", stale)
            nbytes = numel * torch.empty(0, dtype=dtype).element_size()
            problem = shm_shortfall(directory, nbytes, tag)
            if problem is None:
                path = directory / f"{PREFIX}{os.getpid()}-{tag}-{secrets.token_hex(4)}"
                with open(path, "xb") as fh:  # x: never reuse another job's file
                    fh.truncate(nbytes)
        path, problem = self.broadcast_object((str(path) if path is not None else None, problem))
        if problem is not None:  # every local rank says so, none waits on the others
            raise SharedMemoryError(problem)
        try:
            tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        finally:
            self.barrier()  # everyone has mapped it (or failed trying) ...
            if self.local_rank == 0:
                Path(path).unlink(missing_ok=True)  # ... so the name can go: nothing can leak
        return tensor


class SharedMemoryError(DistzoError):
    """The node's shared memory cannot hold what the ranks would share."""


def shm_shortfall(directory: Path, nbytes: int, tag: str) -> str | None:
    """Why a shared segment of `nbytes` would not fit in `directory` (None: it fits). The file is
    created sparse, so without this check a full tmpfs (a container's 64 MB /dev/shm) only shows
    when a page is first touched: SIGBUS, not an error."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if free >= nbytes:
        return None
    gib = 2**30
    return (f"the ranks of this machine share their {tag} in {directory}, which has {free / gib:.2f} GiB free of "
            f"{st.f_blocks * st.f_frsize / gib:.2f} GiB but needs {nbytes / gib:.2f} GiB; enlarge it (docker: "
            "--shm-size; or point DISTZO_SHM_DIR at a larger tmpfs), or use engine.divide_work=false / "
            "comm.sliced=false so each rank keeps its own copy")


def mapped_resident_bytes(tensor: torch.Tensor) -> dict[str, int]:
    """Resident (Rss) and proportional (Pss) bytes of the memory mapping that holds `tensor`, from
    /proc/self/smaps: Pss splits shared pages among the processes mapping them, so summing Pss over
    a node's ranks gives the node's real footprint. Zeros where /proc is unavailable."""
    ptr = tensor.data_ptr()
    out = {"rss": 0, "pss": 0}
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return out
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head in ("Rss:", "Pss:"):
            out[head[:-1].lower()] = int(line.split()[1]) * 1024
    return out
