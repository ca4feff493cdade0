"""Choosing the engine: `build_engine` picks the mode once, from the configuration and the mesh
(the table in distzo/engine/__init__.py and docs/architecture.md#engines)."""

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
from ..telemetry.timing import DISABLED, Timers
from ..zo.estimators import Estimator
from ..zo.optimizers import Optimizer
from .base import Engine, EngineConfigError
from .divided import DividedEngine, division_applies
from .offload import OffloadEngine, SlicedOffloadEngine
from .stacked import StackedLoRAEngine
from .staged import ResidentEngine


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
        return ResidentEngine(model, adapter, params, directions, **common)
    if offload.mode == "cpu":
        dtype = getattr(torch, offload.transfer_dtype) if offload.transfer_dtype else None
        if comm.sliced and mesh.node.shared:
            return SlicedOffloadEngine(model, adapter, params, directions, slots=offload.slots, transfer_dtype=dtype,
                                       node=mesh.node, **common)
        return OffloadEngine(model, adapter, params, directions, slots=offload.slots, transfer_dtype=dtype, **common)
    model.to(directions.device)
    if estimator.batched:
        return StackedLoRAEngine(model, adapter, params, directions, materialize=prge.materialize, **common)
    if work_division(mesh, estimator, engine=engine, offload=offload, peft_method=peft_method):
        return DividedEngine(model, adapter, params, directions, node=mesh.node, **common)
    return ResidentEngine(model, adapter, params, directions, **common)
