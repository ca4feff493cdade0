"""Dividing a step's noise generation and update among the ranks of one node (resident, CPU).

Without division every rank of a node draws the same z for every chunk and applies the same update
to its own copy of the weights: with two ranks, half the node's noise work is redundant, and noise
is most of a ZO step's overhead. With division the node's ranks share one master in host memory
(`Node.shared_tensor`), and for each block every chunk has one owner rank, chosen once by a
size-balanced deterministic assignment. Per block i:

  1. each rank applies the pending update to the chunks it owns (in the shared master), draws eps * z
     of those chunks once per query, and writes them into every working copy the node's ranks need
     (`master +- eps*z`, the operations of an undivided run, so results agree bitwise), in a
     node-shared stage buffer, then *arrives* (an asynchronous all-reduce over the node);
  2. before its forward through block i, each rank waits until every rank has arrived for block i;
  3. it then builds its share of block i+1 (step 1) and only then runs its probes of block i
     on its copies in the stage buffer.

Each chunk is thus read, drawn and written once per node, and z never leaves the owner's cache.
Because a rank builds block i+1 before its forward through block i, a peer has that whole forward
to finish its share of block i+1 before anyone waits for it: jitter between the ranks is absorbed
instead of waited out at every block, as a barrier after each block would make every rank do.

The stage buffer has three slots, used by block index mod 3. A rank writes block i+1's copies only
after the wait for block i, which completes once every rank has arrived for block i, that is, has
finished its forward through block i-2 (it builds block i right after its wait for block i-1, which
precedes its forward through block i-1 but follows that through block i-2). So while block i+1 is
written, the live slots hold blocks i-1 and i. Updates outside the block walk (the embedding-like
outer stage, flushes) are divided the same way and end with a barrier before anyone reads the master.

The design requires every rank of the node to run at least one perturbed probe per step (it
walks every block with its peers); `division_applies` checks that for a plan and mesh. The mode is
the step loop built with a `NodeSharedStore` (the master and the optimizer's state in node-shared
memory) and a `NodeDivision` (who builds and updates which chunks, and the handshakes above).
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from ..config.schema import switch
from ..parallel.mesh import Mesh
from ..parallel.node import Node, mapped_resident_bytes
from ..registry import register, registry
from ..telemetry.timing import DISABLED, Timers
from ..zo.estimators import Probe
from ..zo.optimizers import SGD, Optimizer
from ..zo.params import TrainableParam, TrainableParams
from .base import EngineConfigError
from .build import EngineMode, EngineSetup
from .loop import Division, StageLoop
from .optstate import StateBuffers
from .pending import PendingUpdate
from .stores import ResidentStore
from .weights import StageNoise, StateOf

T = TypeVar("T")


def division_applies(plan: Sequence[Probe], pert: int) -> bool:
    """True when every perturbation rank is dealt (`Mesh.dealt`) at least one perturbed probe
    of the plan."""
    return all(any(plan[i].perturbed for i in Mesh.dealt(len(plan), r, pert)) for r in range(pert))


def share_master(params: TrainableParams, node: Node) -> None:
    """Move every trainable parameter into node-shared host memory (one buffer per dtype); local
    rank 0 fills it (every rank holds the same weights, I1), the others map it. The Parameter objects
    stay the same: only `.data` is re-pointed, so the model and every holder keep working.

    Each parameter is re-pointed as soon as it is copied, so its private storage is freed at once and
    a rank never holds a private and a shared copy of the whole model (that transient was the
    process's peak memory). Other ranks re-point before rank 0 has filled the buffer: nothing reads
    the weights before the barrier below."""
    by_dtype: dict[torch.dtype, list] = {}
    for p in params:
        by_dtype.setdefault(p.tensor.dtype, []).append(p)
    for dtype, group in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        shared = node.shared_tensor(sum(p.numel() for p in group), dtype, "params")
        offset = 0
        for p in group:
            view = shared[offset:offset + p.numel()].view(p.shape)
            if node.local_rank == 0:
                view.copy_(p.tensor.data)
            p.tensor.data = view
            offset += p.numel()
    node.barrier()  # local rank 0 has filled the master


STAGE_SLOTS = 3  # node-shared stage buffers in rotation (see the module docstring for why three)


class Arrival:
    """This rank's announcement that its share of a stage is written; `wait` returns once every rank
    of the node has announced the same stage."""

    def __init__(self, node: Node):
        self._flag = torch.zeros(1)  # kept alive until the collective completes
        self._work = dist.all_reduce(self._flag, group=node.group, async_op=True) if node.group is not None else None

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None


class WorkDivision:
    """A node's division of per-chunk noise and update work (see the module docstring)."""

    def __init__(self, node: Node):
        self.node = node
        self._stage: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    @property
    def rank(self) -> int:
        return self.node.local_rank

    def mine(self, items: Sequence[T], size: Callable[[T], int]) -> list[T]:
        """The items this rank owns: largest first, each to the least loaded rank (ties to the lower
        rank), so every rank computes the same assignment and the loads differ by under one item."""
        load = [0] * self.node.size
        owner = {}
        for j in sorted(range(len(items)), key=lambda j: (-size(items[j]), j)):
            r = min(range(self.node.size), key=lambda r: (load[r], r))
            owner[j] = r
            load[r] += size(items[j])
        return [items[j] for j in range(len(items)) if owner[j] == self.rank]

    def stage_buffer(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A node-shared buffer of at least `numel` elements for one of the STAGE_SLOTS slots of
        working copies. Growing it is collective; every rank asks for the same sizes in the same order."""
        key = (slot, dtype)
        buf = self._stage.get(key)
        if buf is None or buf.numel() < numel:
            self._stage[key] = buf = self.node.shared_tensor(numel, dtype, f"stage{slot}")
        return buf[:numel]

    def arrive(self) -> Arrival:
        """Announce that this rank's share of the current stage is written (split-phase barrier)."""
        return Arrival(self.node)

    def barrier(self) -> None:
        self.node.barrier()


class DividedStageNoise(StageNoise):
    """A stage's working copies built by the node's ranks together: this rank updates and builds only
    the chunks it owns, of every copy any rank of the node needs (`node_evals`: their (query, sign)
    pairs), in node-shared stage slot `slot`, and reads its own copies from there once `ready`
    returns (every peer has written its share)."""

    def __init__(self, *args, division: WorkDivision, slot: int, node_evals: Sequence[tuple[int, int]], **kwargs):
        super().__init__(*args, **kwargs)
        self.division, self.slot, self.node_evals = division, slot, list(node_evals)
        self._arrival: Arrival | None = None  # the node's ranks are still writing their shares

    def ready(self) -> None:
        if self._arrival is not None:
            with self.timers("wait"):
                self._arrival.wait()
            self._arrival = None

    def prepare(self, entries: Sequence[TrainableParam], source: Callable[[TrainableParam], torch.Tensor],
                pending: PendingUpdate | None = None, state: StateOf | None = None) -> None:
        todo = list(entries)
        # Node-shared layout, per dtype: for each node probe in turn, the stage's parameters end to end.
        offset: dict[str, int] = {}
        segment: dict[torch.dtype, int] = {}
        for p in todo:
            offset[p.name] = segment.get(p.tensor.dtype, 0)
            segment[p.tensor.dtype] = offset[p.name] + p.numel()
        buffers = {dtype: self.division.stage_buffer(self.slot, n * len(self.node_evals), dtype)
                   for dtype, n in sorted(segment.items(), key=lambda kv: str(kv[0]))}

        def copy_of(p: TrainableParam, e: int) -> torch.Tensor:
            start = e * segment[p.tensor.dtype] + offset[p.name]
            return buffers[p.tensor.dtype][start:start + p.numel()]

        with self.timers("perturb"):  # the chunks I own: their update, then every node copy of them
            self._perturb_chunks(todo, source, pending, {
                p.name: [(q, sign, copy_of(p, e)) for e, (q, sign) in enumerate(self.node_evals)] for p in todo},
                mine=self.division.mine, state=state)
        self._arrival = self.division.arrive()  # `ready` waits for the peers' shares
        for i, ev in enumerate(self.plan):
            if ev.perturbed:
                e = self.node_evals.index((ev.query, ev.sign))
                self._copies.update({(p.name, i): copy_of(p, e).view(p.shape) for p in todo})


class NodeSharedStore(ResidentStore):
    """Resident weights on CPU, in node-shared host memory every rank of the machine maps: one master
    and one copy of the optimizer's state per node (`share_master`), each chunk written by the rank
    that owns it (`NodeDivision`)."""

    def __init__(self, adapter, params: TrainableParams, optimizer: Optimizer, device: torch.device, node: Node):
        super().__init__(adapter, params, optimizer, device,
                         state=StateBuffers(optimizer.slots, list(params), device, node=node,
                                            initial=optimizer.initial))
        share_master(params, node)
        self.node = node

    def state_resident_bytes(self) -> int:
        return sum(mapped_resident_bytes(buf)["pss"] for buf in self.state.flat)  # this rank's share

    def describe(self) -> str:
        return f"resident, master shared by the node's {self.node.size} ranks, which divide noise and update"


class NodeDivision(Division):
    """A node's ranks dividing a step's noise generation and update (the module docstring): each
    builds and updates the chunks it owns, of every working copy the node's ranks need, and they
    hand over through split-phase barriers. Every rank must run at least one perturbed probe per
    step (`division_applies`), since each walks every block with its peers."""

    with_peers = True

    def __init__(self, node: Node, mesh: Mesh, timers: Timers = DISABLED):
        self.division, self.mesh, self.timers = WorkDivision(node), mesh, timers
        self.mine = self.division.mine
        # Announced when this rank's last perturbed probe has read the shared master for the last
        # time; every write to the master first waits until all peers announced it.
        self._reads_done: Arrival | None = None

    def stage_noise(self, loop: StageLoop, i: int, step: int, plan: Sequence[Probe], perturbed: bool,
                    full_plan: Sequence[Probe] | None) -> StageNoise:
        if not perturbed:
            return loop.noise(step, plan)
        dealt = full_plan if full_plan is not None else plan
        node_evals = sorted({(ev.query, ev.sign)
                             for ev in (dealt[j] for j in self.mesh.node_probes(len(dealt))) if ev.perturbed})
        return DividedStageNoise(loop.directions, loop.workspace, step, loop.eps, plan, loop.timers,
                                 division=self.division, slot=i % STAGE_SLOTS, node_evals=node_evals,
                                 **loop.shaping())

    def before_write(self) -> None:
        """Before this rank changes the shared master, every peer has finished the probe that read
        it (a training step's loss exchange already ensures this; the engine does not rely on its
        caller for it)."""
        if self._reads_done is not None:
            with self.timers("wait"):
                self._reads_done.wait()
            self._reads_done = None

    def after_outer_update(self) -> None:
        self.division.barrier()  # the peers' chunks of the outer stage are updated before anyone reads them

    def after_flush(self) -> None:
        self.division.barrier()

    def look_ahead(self, perturbed: bool) -> bool:
        # A rank builds its share of block i+1 between its wait for block i and its forward through
        # block i, so its peers' jitter is absorbed (the module docstring).
        return perturbed

    def after_walk(self, perturbed: bool) -> None:
        if perturbed:  # every rank of the node runs perturbed probes in step with its peers
            self._reads_done = self.division.arrive()

    def check_clean(self, awaits: bool) -> None:
        if awaits:
            # divided, this rank would update only its own chunks and then read the whole block with no
            # handshake; every clean forward reads materialized weights, which keeps this unreachable
            raise RuntimeError("internal error: a clean forward on a divided engine still awaits an update")


def divided_engine(model, adapter, params, directions, *, node: Node, optimizer: Optimizer | None = None,
                   **kwargs) -> StageLoop:
    """Resident weights on CPU shared by the node's ranks, which divide noise and update."""
    optimizer = optimizer or SGD()
    store = NodeSharedStore(adapter, params, optimizer, directions.device, node)
    division = NodeDivision(node, kwargs.get("mesh") or Mesh.single(directions.device), kwargs.get("timers", DISABLED))
    return StageLoop(model, adapter, params, directions, store, division=division, optimizer=optimizer,
                     mode="divided", **kwargs)


def work_division(s: EngineSetup) -> bool:
    """Whether the node's ranks share the master and divide noise and update work (engine.divide_work):
    `auto` wherever it applies, `true` required (an error naming why it cannot apply), `false` never."""
    mode = switch(s.engine.divide_work)
    if mode == "false":
        return False
    mesh, estimator = s.mesh, s.estimator
    why = None
    if not mesh.node.shared:
        why = "this process has no peers on its machine"
    elif mesh.device.type != "cpu":
        why = "it divides host-side work (CPU runs only)"
    elif s.offload.mode != "none":
        why = "offloaded runs divide the update by slices already (comm.sliced)"
    elif not estimator.streams_blocks or s.peft_method != "none":
        why = (f"it serves full-parameter runs of the block-streaming estimators "
               f"({registry('estimator').having('streams_blocks')}); the others and the trainable sets evaluate "
               "their own way")
    elif not division_applies(estimator.dealt_plan(), mesh.shape.pert):
        why = f"a perturbation rank of mesh {mesh.shape} would have no perturbed probe in the estimator's plan"
    if why is not None and mode == "true":
        raise EngineConfigError(f"engine.divide_work=true cannot apply: {why}; use engine.divide_work=auto")
    return why is None


@register("engine_mode", "divided")
class DividedMode(EngineMode):
    """Resident on CPU with several ranks on a machine: one node-shared master, work divided."""

    precedence = 10

    @classmethod
    def applies(cls, s: EngineSetup) -> bool:
        return not s.estimator.stacked and work_division(s)

    @classmethod
    def build(cls, s: EngineSetup) -> StageLoop:
        s.model.to(s.device)
        return divided_engine(s.model, s.adapter, s.params, s.directions, node=s.mesh.node, **s.loop_options())
