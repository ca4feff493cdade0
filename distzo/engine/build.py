"""The engine's modes and `build_engine`, which picks one once from the configuration and the mesh
(docs/architecture.md#engines).

A mode is the step loop (`distzo.engine.loop.StageLoop`) built with the parts it needs: a weight
store, a division of the node's work, stacked probes. Each mode is a class registered as an engine
mode (`@register("engine_mode", name)`, distzo.registry) beside its store, saying when it applies to
a run (`applies`) and building its loop (`build`); `build_engine` asks the registered modes in order
of `precedence` (highest first) and builds the first that applies. A new store is its module with
its mode; the loop and this module do not change.

| mode | store (module) | applies | precedence |
|---|---|---|---|
| `offload-base-sliced` | `StreamedBaseStore` over the node (streamed_base.py) | offload=cpu with peft, several ranks per node, comm.sliced | 41 |
| `offload-base` | `StreamedBaseStore` (streamed_base.py) | offload=cpu with peft (adapters resident, the frozen base streamed) | 40 |
| `offload-sliced` | `SlicedOffloadStore` (offload.py) | offload=cpu, several ranks per node, comm.sliced | 31 |
| `offload` | `OffloadStore` (offload.py) | offload=cpu | 30 |
| `stacked-lora` | `ResidentStore` with `StackedProbes` (stacked.py) | a stacked estimator (P-RGE) | 20 |
| `divided` | `NodeSharedStore` with `NodeDivision` (divided.py) | CPU, several ranks on a machine, full-parameter MeZO (engine.divide_work) | 10 |
| `resident` | `ResidentStore` (stores.py; this module) | always: every weight on the compute device | 0 |
"""  # noqa: E501 (a markdown table above: its rows cannot wrap)

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..config.schema import CommConfig, EngineConfig, OffloadConfig, switch
from ..parallel.mesh import Mesh
from ..registry import register, registry
from ..telemetry.timing import DISABLED, Timers
from ..zo.directions import Directions
from ..zo.estimators import Estimator
from ..zo.optimizers import SGD, Optimizer
from ..zo.params import TrainableParams
from .base import Engine, EngineConfigError
from .loop import StageLoop
from .stores import ResidentStore


@dataclass
class EngineSetup:
    """What picks a mode and builds its loop: the run's engine-related settings, the mesh, and the
    model's parts. resident: the resident mode whatever the settings (replay)."""

    mesh: Mesh
    model: torch.nn.Module
    adapter: Any
    params: TrainableParams
    directions: Directions
    estimator: Estimator
    engine: EngineConfig
    offload: OffloadConfig
    comm: CommConfig
    peft_method: str
    micro_batch_size: int | None = None
    timers: Timers = DISABLED
    optimizer: Optimizer | None = None
    resident: bool = False

    @property
    def device(self) -> torch.device:
        return self.directions.device

    @property
    def node_shared(self) -> bool:
        """Several ranks of this machine, set to share what they hold (comm.sliced)."""
        return bool(self.comm.sliced and self.mesh.node.shared)

    def loop_options(self) -> dict[str, Any]:
        """The loop's settings every mode passes on (StageLoop's keyword arguments)."""
        return dict(eps=self.estimator.eps, mesh=self.mesh, row_tokens=self.engine.row_tokens,
                    fuse_update=switch(self.engine.fuse_update) != "false",
                    micro_batch_size=self.micro_batch_size, compute=str(self.engine.compute), timers=self.timers,
                    optimizer=self.optimizer or SGD(), decode_cache=switch(self.engine.decode_cache))


class EngineMode:
    """A way to run the step loop (see the module docstring). name: set by `register`; it is the
    summary's `engine` field."""

    name: ClassVar[str]
    precedence: ClassVar[int] = 0

    @classmethod
    def applies(cls, s: EngineSetup) -> bool:
        raise NotImplementedError

    @classmethod
    def build(cls, s: EngineSetup) -> StageLoop:
        raise NotImplementedError


def copy_stream_applies(s: EngineSetup) -> bool:
    """`engine.copy_stream` for a resident run: "auto" on CUDA for sgd over plain directions, "true"
    on CUDA (an error elsewhere), "false" never."""
    want = switch(s.engine.copy_stream)
    if want == "false":
        return False
    if s.device.type != "cuda":
        if want == "true":
            raise EngineConfigError(f"engine.copy_stream=true overlaps two CUDA streams, and this run computes on "
                                    f"{s.device.type}; use engine.copy_stream=auto")
        return False
    optimizer = s.optimizer or SGD()
    plain = type(s.directions) is Directions and type(optimizer).update is SGD.update
    return want == "true" or (plain and not optimizer.shapes_directions)


def resident_engine(model, adapter, params, directions, *, optimizer: Optimizer | None = None, **kwargs) -> StageLoop:
    """Every weight on the compute device."""
    optimizer = optimizer or SGD()
    store = ResidentStore(adapter, params, optimizer, directions.device)
    return StageLoop(model, adapter, params, directions, store, optimizer=optimizer, mode="resident", **kwargs)


@register("engine_mode", "resident")
class ResidentMode(EngineMode):
    precedence = 0

    @classmethod
    def applies(cls, s: EngineSetup) -> bool:
        return True

    @classmethod
    def build(cls, s: EngineSetup) -> StageLoop:
        s.model.to(s.device)
        return resident_engine(s.model, s.adapter, s.params, s.directions, copy_stream=copy_stream_applies(s),
                               **s.loop_options())


def build_engine(s: EngineSetup) -> Engine:
    """The engine of the first registered mode (by precedence) that applies to the run, with the
    model placed accordingly; every mode holds the optimizer's state where it holds the master."""
    if str(s.engine.compute) == "tf32":
        if s.device.type != "cuda":
            raise EngineConfigError("engine.compute=tf32 runs float32 products on CUDA tensor cores; on "
                                    f"{s.device.type} use engine.compute=fp32 or bf16")
        # Process-wide: every float32 product (the forward's, AGZO's bases) takes TF32, everywhere alike.
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if not s.adapter.blocks and s.offload.mode == "cpu":
        raise EngineConfigError(f"{s.adapter.arch} runs on the whole-model fallback, which has no decoder blocks to "
                                "stream; use offload=none")
    if not s.adapter.blocks and s.estimator.stacked:
        raise EngineConfigError(f"{s.adapter.arch} runs on the whole-model fallback, where P-RGE cannot stack its "
                                "probes per block; use estimator=mezo or estimator=agzo")
    modes = registry("engine_mode")
    if s.resident:
        return modes.get("resident").build(s)
    for _, mode in sorted(modes.items(), key=lambda item: -item[1].precedence):
        if mode.applies(s):
            if mode.name != "resident" and switch(s.engine.copy_stream) == "true":
                raise EngineConfigError(f"engine.copy_stream=true builds copies beside the forward for resident "
                                        f"weights, and this run's engine is {mode.name}; use engine.copy_stream=auto")
            return mode.build(s)
    raise AssertionError("the resident mode always applies")
