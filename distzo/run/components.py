"""Everything a run of a configuration needs, built once: model, task, trainable set, engine,
estimator, sampler. Training, `bench` and `eval` build their runs here."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .. import native
from ..data.tasks import PromptTask, TrainSampler
from ..engine import Engine, build_engine
from ..errors import DistzoError
from ..models import adapter_for, load_model
from ..parallel.mesh import Mesh
from ..peft import apply_peft
from ..telemetry.timing import DISABLED, Timers, WorkClock
from ..zo.directions import Directions
from ..zo.estimators import Estimator, build_estimator
from ..zo.params import TrainableParams
from ..zo.subspace import ActivationCapture, SubspaceDirections

log = logging.getLogger("distzo")


class NothingToTrain(DistzoError):
    pass


@dataclass
class Components:
    cfg: Any
    mesh: Mesh
    seed: int
    model: torch.nn.Module
    tokenizer: Any
    task: PromptTask
    params: TrainableParams
    engine: Engine
    estimator: Estimator
    sampler: TrainSampler
    capture: ActivationCapture | None = None  # AGZO: the clean forward's activation bases

    def close(self) -> None:
        self.engine.close()
        self.engine.directions.close()


def build_components(cfg, mesh: Mesh, seed: int, weights: Mapping[str, torch.Tensor] | None = None,
                     timers: Timers = DISABLED, clock: WorkClock | None = None) -> Components:
    """weights: trainable tensors to start from (a snapshot's), by canonical name. timers / clock:
    phase timers and the noise threads' work clock (`bench`)."""
    kernels = native.load(cfg.engine.native, mesh.device)  # None: torch ops (same values); first, it may fail
    model, tokenizer = load_model(cfg.model)
    task = PromptTask(cfg.task, tokenizer, str(cfg.objective))
    est = cfg.estimator
    apply_peft(model, cfg.peft)  # freezes the model and adds the adapter's parameters (peft != none)
    if est.name == "agzo" and est.agzo.tied_embeddings == "freeze":
        freeze_tied_embeddings(model)
    params = TrainableParams.from_model(model)
    if len(params) == 0:
        raise NothingToTrain("nothing to train: every parameter is frozen (check peft and estimator.agzo.tied_embeddings)")
    if weights is not None:
        load_weights(params, weights)
    agzo = est.name == "agzo"
    directions = (SubspaceDirections if agzo else Directions)(seed, str(est.distribution), mesh.device,
                                                             kernels=kernels, clock=clock)
    estimator = build_estimator(est)
    engine = build_engine(cfg, mesh, model, adapter_for(model, str(cfg.model.adapter)), params, directions, estimator, timers)
    capture = ActivationCapture(model, params, directions, est.agzo.rank, est.agzo.power_iters) if agzo else None
    return Components(cfg, mesh, seed, model, tokenizer, task, params, engine, estimator,
                      TrainSampler(task.size("train"), cfg.batch_size, seed), capture)


def load_weights(params: TrainableParams, tensors: Mapping[str, torch.Tensor], origin: str = "the snapshot") -> None:
    names = {p.name for p in params}
    if set(tensors) != names:
        raise DistzoError(f"{origin} holds other parameters than this model trains (missing "
                          f"{sorted(names - set(tensors))[:3]}, extra {sorted(set(tensors) - names)[:3]}); "
                          "use the model, peft and estimator settings it was written with")
    with torch.no_grad():
        for p in params:
            p.tensor.copy_(tensors[p.name])


def freeze_tied_embeddings(model: torch.nn.Module) -> None:
    """AGZO's tied-embedding policy `freeze`: a token embedding that is also the LM head trains
    neither as a table (dense noise over every row would swamp the subspace directions' advantage)
    nor as a linear layer (the head is read by label rows, so it has no input activations here)."""
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    if head is not None and embed is not None and head.weight is embed.weight:
        embed.weight.requires_grad_(False)
