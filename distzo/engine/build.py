"""The engine's modes: the step loop (`distzo.engine.loop.StageLoop`) built with the parts a mode
needs, and `build_engine`, which picks the mode once from the configuration and the mesh
(docs/architecture.md#engines).

| mode | store | division | other parts | when |
|---|---|---|---|---|
| `resident` | `ResidentStore` | none | | the default |
| `divided` | `NodeSharedStore` | `NodeDivision` | | CPU, resident, several ranks on a machine, full-parameter MeZO (engine.divide_work) |
| `offload` | `OffloadStore` | none | | offload=cpu with one rank per node, or comm.sliced=false |
| `offload-sliced` | `SlicedOffloadStore` | none | | offload=cpu with several ranks per node and comm.sliced=true |
| `stacked-lora` | `ResidentStore` | none | `BatchedProbes` | estimator=prge (P-RGE's batched forward) |
| `offload-base` | `StreamedBaseStore` | none | `BatchedProbes` with estimator=prge | offload=cpu with peft (adapters resident, the frozen base streamed) |
| `offload-base-sliced` | `StreamedBaseStore` over the node | none | likewise | the same with several ranks per node and comm.sliced=true |

Each mode is one function here; a new mode is a new store (or division) and one function.
"""  # noqa: E501 (a markdown table above: its rows cannot wrap)

from __future__ import annotations

import torch

from ..config.schema import (
    CommConfig,
    EngineConfig,
    OffloadConfig,
    PeftMethod,
    PRGEConfig,
)
from ..parallel.mesh import Mesh
from ..parallel.node import Node
from ..telemetry.timing import DISABLED, Timers
from ..zo.estimators import Estimator
from ..zo.optimizers import SGD, Optimizer
from .base import Engine, EngineConfigError
from .divided import NodeDivision, NodeSharedStore, division_applies
from .loop import StageLoop
from .offload import OffloadStore, SlicedOffloadStore
from .stacked import BatchedProbes
from .stores import ResidentStore
from .streamed_base import StreamedBaseStore


def resident_engine(model, adapter, params, directions, *, optimizer: Optimizer | None = None, **kwargs) -> StageLoop:
    """Every weight on the compute device."""
    optimizer = optimizer or SGD()
    store = ResidentStore(adapter, params, optimizer, directions.device)
    return StageLoop(model, adapter, params, directions, store, optimizer=optimizer, mode="resident", **kwargs)


def divided_engine(model, adapter, params, directions, *, node: Node, optimizer: Optimizer | None = None,
                  **kwargs) -> StageLoop:
    """Resident weights on CPU shared by the node's ranks, which divide noise and update (engine/divided.py)."""
    optimizer = optimizer or SGD()
    store = NodeSharedStore(adapter, params, optimizer, directions.device, node)
    division = NodeDivision(node, kwargs.get("mesh") or Mesh.single(directions.device), kwargs.get("timers", DISABLED))
    return StageLoop(model, adapter, params, directions, store, division=division, optimizer=optimizer,
                     mode="divided", **kwargs)


def offload_engine(model, adapter, params, directions, *, slots: int = 3, transfer_dtype: torch.dtype | None = None,
                  optimizer: Optimizer | None = None, **kwargs) -> StageLoop:
    """Blocks in host memory, streamed whole through a device slot ring (engine/offload.py)."""
    optimizer = optimizer or SGD()
    store = OffloadStore(model, adapter, params, optimizer, directions.device, slots=slots,
                         transfer_dtype=transfer_dtype)
    return StageLoop(model, adapter, params, directions, store, optimizer=optimizer, mode="offload", **kwargs)


def sliced_offload_engine(model, adapter, params, directions, *, node: Node, slots: int = 3,
                        transfer_dtype: torch.dtype | None = None, optimizer: Optimizer | None = None,
                        **kwargs) -> StageLoop:
    """One node-shared host master; each rank moves a slice of every block (DistZO2, engine/offload.py)."""
    optimizer = optimizer or SGD()
    store = SlicedOffloadStore(model, adapter, params, optimizer, directions.device, node=node, slots=slots,
                               transfer_dtype=transfer_dtype)
    return StageLoop(model, adapter, params, directions, store, optimizer=optimizer, mode="offload-sliced", **kwargs)


def stacked_lora_engine(model, adapter, params, directions, *, materialize: bool = True,
                      optimizer: Optimizer | None = None, **kwargs) -> StageLoop:
    """P-RGE: a rank's probes in one batched forward over stacked LoRA-FA B copies (engine/stacked.py)."""
    optimizer = optimizer or SGD()
    store = ResidentStore(adapter, params, optimizer, directions.device)
    return StageLoop(model, adapter, params, directions, store, batched=BatchedProbes(model, params, materialize),
                     optimizer=optimizer, mode="stacked-lora", **kwargs)


def streamed_base_engine(model, adapter, params, directions, *, slots: int = 3, node: Node | None = None,
                         batched: BatchedProbes | None = None, optimizer: Optimizer | None = None,
                         **kwargs) -> StageLoop:
    """Adapters resident, the frozen (possibly quantized) base streamed from host memory, whole or
    sliced over the node's ranks (engine/streamed_base.py)."""
    optimizer = optimizer or SGD()
    store = StreamedBaseStore(model, adapter, params, optimizer, directions.device, slots=slots, node=node)
    mode = "offload-base-sliced" if node is not None else "offload-base"
    return StageLoop(model, adapter, params, directions, store, batched=batched, optimizer=optimizer, mode=mode,
                     **kwargs)


def work_division(mesh: Mesh, estimator: Estimator, *, engine: EngineConfig, offload: OffloadConfig,
                  peft_method: PeftMethod) -> bool:
    """Whether the node's ranks share the master and divide noise and update work (engine.divide_work):
    `auto` wherever it applies, `true` required (an error naming why it cannot apply), `false` never."""
    mode = str(engine.divide_work).lower()
    if mode == "false":
        return False
    why = None
    if not mesh.node.shared:
        why = "this process has no peers on its machine"
    elif mesh.device.type != "cpu":
        why = "it divides host-side work (CPU runs only)"
    elif offload.mode != "none":
        why = "offloaded runs divide the update by slices already (comm.sliced)"
    elif not estimator.streams_blocks or peft_method != "none":
        why = "it serves full-parameter estimator=mezo (other estimators and trainable sets evaluate their own way)"
    elif not division_applies(estimator.dealt_plan(), mesh.shape.pert):
        why = f"a perturbation rank of mesh {mesh.shape} would have no perturbed probe in the estimator's plan"
    if why is not None and mode == "true":
        raise EngineConfigError(f"engine.divide_work=true cannot apply: {why}; use engine.divide_work=auto")
    return why is None


def build_engine(mesh: Mesh, model, adapter, params, directions, estimator: Estimator, *, engine: EngineConfig,
                 offload: OffloadConfig, comm: CommConfig, micro_batch_size: int | None, prge: PRGEConfig,
                 peft_method: PeftMethod, timers: Timers = DISABLED, resident: bool = False,
                 optimizer: Optimizer | None = None) -> Engine:
    """The engine the run's sub-configs ask for (`engine`, `offload`, `comm`, the estimator's `prge`,
    the `peft` method), with the model placed accordingly. resident: the resident engine whatever the
    configuration (replay). optimizer: the update rule and its state (sgd when None), which every
    mode holds where it holds the master."""
    compute = str(engine.compute)
    if compute == "tf32":
        if directions.device.type != "cuda":
            raise EngineConfigError("engine.compute=tf32 runs float32 products on CUDA tensor cores; on "
                                    f"{directions.device.type} use engine.compute=fp32 or bf16")
        # Process-wide: every float32 product (the forward's, AGZO's bases) takes TF32, everywhere alike.
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    common = dict(eps=estimator.eps, mesh=mesh, row_tokens=engine.row_tokens,
                  fuse_update=str(engine.fuse_update).lower() != "false", micro_batch_size=micro_batch_size,
                  compute=compute, timers=timers, optimizer=optimizer)
    if not adapter.blocks and offload.mode == "cpu":
        raise EngineConfigError(f"{adapter.arch} runs on the whole-model fallback, which has no decoder blocks to "
                                "stream; use offload=none")
    if not adapter.blocks and estimator.batched:
        raise EngineConfigError(f"{adapter.arch} runs on the whole-model fallback, where P-RGE cannot batch its "
                                "probes per block; use estimator=mezo or estimator=agzo")
    if resident:
        model.to(directions.device)
        return resident_engine(model, adapter, params, directions, **common)
    if offload.mode == "cpu" and peft_method != "none":
        batched = BatchedProbes(model, params, prge.materialize) if estimator.batched else None
        return streamed_base_engine(model, adapter, params, directions, slots=offload.slots, batched=batched,
                                    node=mesh.node if comm.sliced and mesh.node.shared else None, **common)
    if offload.mode == "cpu":
        dtype = getattr(torch, offload.transfer_dtype) if offload.transfer_dtype else None
        if comm.sliced and mesh.node.shared:
            return sliced_offload_engine(model, adapter, params, directions, slots=offload.slots, transfer_dtype=dtype,
                                       node=mesh.node, **common)
        return offload_engine(model, adapter, params, directions, slots=offload.slots, transfer_dtype=dtype, **common)
    model.to(directions.device)
    if estimator.batched:
        return stacked_lora_engine(model, adapter, params, directions, materialize=prge.materialize, **common)
    if work_division(mesh, estimator, engine=engine, offload=offload, peft_method=peft_method):
        return divided_engine(model, adapter, params, directions, node=mesh.node, **common)
    return resident_engine(model, adapter, params, directions, **common)
