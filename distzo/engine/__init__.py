"""Engines run a step's forward evaluations and its update (docs/architecture.md#engines).

`build_engine` picks the mode once, from the configuration and the mesh:

| mode | class | when |
|---|---|---|
| resident | `ResidentEngine` | the default |
| work-divided | `DividedEngine` | CPU, resident, several ranks on a machine, full-parameter MeZO (engine.divide_work) |
| offloaded | `OffloadEngine` | offload=cpu with one rank per node, or comm.sliced=false |
| offloaded, sliced | `SlicedOffloadEngine` | offload=cpu with several ranks per node and comm.sliced=true |
| stacked LoRA | `StackedLoRAEngine` | estimator=prge (P-RGE's batched forward) |
"""

from __future__ import annotations

import logging

import torch

from ..errors import DistzoError
from ..parallel.mesh import Mesh
from ..telemetry.timing import DISABLED, Timers
from ..zo.estimators import Estimator
from .base import Engine, Materialized
from .divided import DividedEngine, division_applies
from .offload import OffloadEngine, SlicedOffloadEngine
from .stacked import StackedLoRAEngine
from .staged import ResidentEngine, StagedEngine

log = logging.getLogger("distzo")


class EngineConfigError(DistzoError):
    """An engine setting that cannot apply to this run."""


def work_division(cfg, mesh: Mesh, estimator: Estimator) -> bool:
    """Whether the node's ranks share the master and divide noise and update work (engine.divide_work):
    `auto` wherever it applies, `true` required (an error naming why it cannot apply), `false` never."""
    mode = str(cfg.engine.divide_work).lower()
    if mode == "false":
        return False
    why = None
    if not mesh.node.shared:
        why = "this process has no peers on its machine"
    elif mesh.device.type != "cpu":
        why = "it divides host-side work (CPU runs only)"
    elif cfg.offload.mode != "none":
        why = "offloaded runs divide the update by slices already (comm.sliced)"
    elif cfg.estimator.name != "mezo" or cfg.peft.method != "none":
        why = "it serves full-parameter estimator=mezo (other estimators and trainable sets evaluate their own way)"
    elif not division_applies(estimator.dealt_plan(), mesh.shape.pert):
        why = f"a perturbation rank of mesh {mesh.shape} would have no perturbed evaluation in the estimator's plan"
    if why is not None and mode == "true":
        raise EngineConfigError(f"engine.divide_work=true cannot apply: {why}; use engine.divide_work=auto")
    return why is None


def build_engine(cfg, mesh: Mesh, model, adapter, params, directions, estimator: Estimator,
                 timers: Timers = DISABLED) -> Engine:
    """The engine a run config asks for (`offload`, `comm`, `engine`, the estimator), with the model
    placed accordingly."""
    off, opts = cfg.offload, cfg.engine
    compute = str(opts.compute)
    if compute == "tf32":
        if directions.device.type != "cuda":
            raise EngineConfigError("engine.compute=tf32 runs float32 products on CUDA tensor cores; on "
                                    f"{directions.device.type} use engine.compute=fp32 or bf16")
        # Process-wide: every float32 product (the forward's, AGZO's bases) takes TF32, everywhere alike.
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    common = dict(eps=estimator.eps, mesh=mesh, row_tokens=opts.row_tokens,
                  fuse_update=str(opts.fuse_update).lower() != "false", micro_batch_size=cfg.micro_batch_size,
                  compute=compute, timers=timers)
    if not adapter.blocks and off.mode == "cpu":
        raise EngineConfigError(f"{adapter.arch} runs on the whole-model fallback, which has no decoder blocks to "
                                "stream; use offload=none")
    if not adapter.blocks and estimator.batched:
        raise EngineConfigError(f"{adapter.arch} runs on the whole-model fallback, where P-RGE cannot batch its "
                                "evaluations per block; use estimator=mezo or estimator=agzo")
    if off.mode == "cpu":
        dtype = getattr(torch, off.transfer_dtype) if off.transfer_dtype else None
        if cfg.comm.sliced and mesh.node.shared:
            return SlicedOffloadEngine(model, adapter, params, directions, slots=off.slots, transfer_dtype=dtype,
                                       node=mesh.node, **common)
        return OffloadEngine(model, adapter, params, directions, slots=off.slots, transfer_dtype=dtype, **common)
    model.to(directions.device)
    if estimator.batched:
        return StackedLoRAEngine(model, adapter, params, directions, materialize=cfg.estimator.prge.materialize,
                                 **common)
    if work_division(cfg, mesh, estimator):
        return DividedEngine(model, adapter, params, directions, node=mesh.node, **common)
    return ResidentEngine(model, adapter, params, directions, **common)

__all__ = ["DividedEngine", "Engine", "EngineConfigError", "Materialized", "OffloadEngine", "ResidentEngine",
           "SlicedOffloadEngine", "StackedLoRAEngine", "StagedEngine", "build_engine", "division_applies",
           "work_division"]
