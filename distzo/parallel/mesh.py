"""The PxD device mesh: P ranks along the perturbation axis (inner: neighbouring ranks, same node),
D ranks along the data axis. Rank r has perturbation index r % P and data index r // P.

What crosses the network per step is a handful of float64 scalars: each rank fills the rows of the
probes it ran (loss sum, example count) on its data shard, an all-reduce over the perturbation
group assembles all probes (an all-gather of disjoint rows), and an all-reduce over the data
group sums the shards. Every rank then holds every probe's exact loss over the global batch and
applies the identical update, so weights never travel.

A 1x1 mesh needs no torch.distributed at all: the collectives are identities.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from ..errors import DistzoError
from .launch_env import launched_local_rank, launched_world_size
from .node import Node
from .shape import MeshError, MeshShape

T = TypeVar("T")
log = logging.getLogger(__name__)


def _restart_safe_store(timeout: datetime.timedelta) -> dict[str, Any]:
    """Under torchrun the agent's store outlives a restart (`--max-restarts`): a restarted group
    would read the dead attempt's peer addresses and fail to connect. Namespacing every key by the
    restart count gives each attempt a clean slate; sub-groups inherit the default group's store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return {}
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                         timeout=timeout)
    store = dist.PrefixStore(f"distzo/attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}", base)
    return {"store": store, "rank": rank, "world_size": world}


def device_type(name: str) -> str:
    """The device type a `device` setting means here: auto is cuda where a GPU is visible, else cpu."""
    name = str(name)
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise MeshError("device=cuda but no CUDA device is visible; use device=cpu or device=auto")
    return name


# What gloo and NCCL say when a collective fails because another rank is gone (killed, crashed, or
# stopped by its launcher), or never answered within the timeout.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote worker crashing",
              "Connection refused", "NCCL communicator was aborted", "Timed out waiting", "Socket Timeout")


def peer_failure(exc: BaseException) -> str | None:
    """One line for an error raised by a collective whose peers are gone, or None for any other
    error (which keeps its traceback). The rank that failed first reports its own cause; the others
    only need to say that they lost it."""
    if not isinstance(exc, RuntimeError):  # torch.distributed's DistError family subclasses it
        return None
    text = " ".join(str(exc).split())
    if not any(marker in text for marker in _PEER_GONE):
        return None
    if text.startswith("[") and "] " in text:  # gloo's source location
        text = text.split("] ", 1)[1]
    cause = text.split(". ", 1)[0].rstrip(".")[:160]
    rank = os.environ.get("RANK", "0")
    return (f"rank {rank} lost its peers ({cause}): another rank of the job stopped first, and its own message, "
            "or the launcher's, says why")


class Mesh:
    """Ranks, roles and the step's collectives for one run."""

    def __init__(self, shape: MeshShape, device: torch.device, rank: int = 0, device_mesh: Any = None,
                 node: Node | None = None, owns_default_group: bool = True):
        self.shape, self.device, self.rank = shape, device, rank
        # False where the default group was there before (accelerate's, under ZOTrainer): close()
        # then takes down the groups this mesh made and leaves the default one to its owner.
        self.owns_default_group = owns_default_group
        self.world_size = shape.size
        self.device_mesh = device_mesh
        self.node = node or Node.single()  # the ranks of this machine (shared host memory, slices)
        self._patient_group: Any = None  # gloo over every rank, waiting up to a day (all_gather_object)
        if device_mesh is None:  # 1x1, or roles computed for a rank without processes (tests, planning)
            self.pert_rank, self.data_rank = rank % shape.pert, rank // shape.pert
            self._pert_group = self._data_group = None
        else:
            self.pert_rank, self.data_rank = device_mesh.get_local_rank("pert"), device_mesh.get_local_rank("data")
            self._pert_group, self._data_group = device_mesh.get_group("pert"), device_mesh.get_group("data")

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> Mesh:
        """The 1x1 mesh of a process on its own (no torch.distributed)."""
        return cls(MeshShape(1, 1), torch.device(device))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.device_mesh is not None

    @classmethod
    def create(cls, text: str, device: str = "cpu", timeout_s: float = 600.0) -> Mesh:
        """Parse and check the mesh against the launched world, then (for more than one process)
        initialise the process group and a DeviceMesh with named dims ("data", "pert").
        device: auto (CUDA where visible), cpu or cuda."""
        device_kind = device_type(device)
        shape = MeshShape.parse(text)
        world = launched_world_size()
        shape.check_world(world)
        if world == 1:
            return cls(shape, torch.device(device_kind))
        from torch.distributed.device_mesh import init_device_mesh

        local_rank = launched_local_rank()
        timeout = datetime.timedelta(seconds=timeout_s)
        if device_kind == "cuda":
            if local_rank >= torch.cuda.device_count():
                raise MeshError(f"local rank {local_rank} has no GPU: this node shows {torch.cuda.device_count()}; "
                                f"start at most {torch.cuda.device_count()} processes per node (--nproc-per-node)")
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
            backend, options = "nccl", dist.ProcessGroupNCCL.Options()
        else:
            device, backend, options = torch.device("cpu"), "gloo", dist.ProcessGroupGloo._Options()
        options._timeout = timeout  # DeviceMesh takes its sub-groups' timeout from the options
        owns = not dist.is_initialized()
        if owns:
            dist.init_process_group(backend=backend, timeout=timeout, **_restart_safe_store(timeout))
        device_mesh = init_device_mesh(device.type, (shape.data, shape.pert), mesh_dim_names=("data", "pert"),
                                       backend_override={"data": (backend, options), "pert": (backend, options)})
        return cls(shape, device, dist.get_rank(), device_mesh, Node.create(backend, timeout), owns)

    # --- roles -------------------------------------------------------------------------------------

    @staticmethod
    def dealt(n: int, pert_rank: int, pert: int) -> list[int]:
        """Indices, among n probes, that perturbation rank `pert_rank` of `pert` runs: dealt
        round-robin. The one rule for who runs what (work division checks plans against it too)."""
        return list(range(pert_rank, n, pert))

    def my_probes(self, n: int) -> list[int]:
        """Indices of the plan's probes this rank runs."""
        return self.dealt(n, self.pert_rank, self.shape.pert)

    def node_probes(self, n: int) -> list[int]:
        """Indices of the plan's probes some rank of this node runs (a node holds consecutive
        ranks, `Node.create`)."""
        first = self.rank - self.node.local_rank
        perts = {(first + j) % self.shape.pert for j in range(self.node.size)}
        return sorted(i for r in perts for i in self.dealt(n, r, self.shape.pert))

    # --- collectives -------------------------------------------------------------------------------

    def exchange(self, local: torch.Tensor) -> torch.Tensor:
        """[n_evaluations, k] float64, rows of this rank's probes filled, others zero ->
        the global values on every rank (all-gather along pert, then sum along data)."""
        out = local.to(dtype=torch.float64, device=self._collective_device())
        if self.distributed:
            if self.shape.pert > 1:
                dist.all_reduce(out, group=self._pert_group)
            if self.shape.data > 1:
                dist.all_reduce(out, group=self._data_group)
        return out.cpu()

    def all_sum(self, values: Sequence[float]) -> list[float]:
        """Sum float64 values over every rank (e.g. evaluation counts of a split sharded over all ranks)."""
        t = torch.tensor(list(values), dtype=torch.float64)
        if self.distributed:
            t = t.to(self._collective_device())
            dist.all_reduce(t)
        return t.cpu().tolist()

    def barrier(self) -> None:
        """Every rank has reached this point: an all-reduce of one number. On CPU (gloo) the waiting
        ranks sleep rather than spin, so a rank timed while its peers wait here has the machine to
        itself (`bench`)."""
        self.all_sum([0.0])

    def all_gather_int(self, value: int) -> list[int]:
        if not self.distributed:
            return [value]
        t = torch.tensor([value], dtype=torch.int64, device=self._collective_device())
        out = [torch.zeros_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t)
        return [int(x) for x in out]

    def all_gather_floats(self, values: Sequence[float]) -> list[list[float]]:
        """Every rank's list of floats (same length everywhere), in rank order."""
        if not self.distributed:
            return [list(values)]
        t = torch.tensor(list(values), dtype=torch.float64, device=self._collective_device())
        out = [torch.zeros_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t)
        return [x.cpu().tolist() for x in out]

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's object on every rank (seeds, the run directory)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def decided_on_main(self, question: Callable[[], T]) -> T:
        """question() asked on rank 0 alone and its answer returned on every rank: for what every rank
        must agree on and one process should read (a shared folder, whose view may differ between
        nodes for a while; a log; the hub). Where rank 0 raises, every rank raises, so none waits out
        the timeout for an answer that never comes: a DistzoError as itself (the same line on each
        rank), anything else as a RuntimeError naming it (rank 0 raises the original)."""
        if not self.distributed:
            return question()
        answer, error, failure = None, None, None
        if self.is_main:
            try:
                answer = question()
            except DistzoError as exc:
                error = exc
            except Exception as exc:
                failure = exc
        answer, error, problem = self.broadcast_object((answer, error, None if failure is None else repr(failure)))
        if failure is not None:
            raise failure
        if error is not None:
            raise error
        if problem is not None:
            raise RuntimeError(f"rank 0 failed where every rank waits on its answer: {problem}")
        return answer

    def all_gather_object(self, obj: Any, patient: bool = False) -> list[Any]:
        """Every rank's object, in rank order. patient: over a group that waits up to a day instead of
        the run's dist_timeout_s, for work whose length is not a step's (a node fetching a model)."""
        if not self.distributed:
            return [obj]
        group = None
        if patient:
            if self._patient_group is None:  # created by every rank alike: they all reach the same call
                self._patient_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=1))
            group = self._patient_group
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    def _collective_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def close(self) -> None:
        """Take down the process groups: all of them where this mesh initialised the default group;
        otherwise only those it made (its axes', the node's, the patient one), so that the default
        group's owner (accelerate under transformers' Trainer) keeps using it."""
        if self.distributed and dist.is_initialized():
            if self.owns_default_group:
                dist.destroy_process_group()
            else:
                world = dist.group.WORLD
                made = [self._pert_group, self._data_group, self._patient_group, *self.node.groups()]
                for group in {id(g): g for g in made if g is not None and g is not world}.values():
                    if group != dist.GroupMember.NON_GROUP_MEMBER:
                        dist.destroy_process_group(group)
        self.device_mesh = None
        self._pert_group = self._data_group = self._patient_group = None
